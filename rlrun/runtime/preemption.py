"""SIGTERM and SIGUSR1 ask the run to checkpoint and stop after the current step.

Slurm sends SIGTERM on preemption and ``scancel`` (then SIGKILL after its grace time) and, with
``#SBATCH --signal=USR1@T``, SIGUSR1 T seconds before the time limit; torchrun forwards SIGTERM
(and SIGUSR1 with ``--signals-to-handle``) to its ranks. The handler only records the request:
ranks see a signal at different moments, so after every step they agree with one all-reduce
(:meth:`StopRequest.agreed`) and all stop after the same step, which makes one consistent
checkpoint. SIGINT (Ctrl-C) keeps Python's default: stop at once, no checkpoint.

The engine worker must outlive the signal until its rank has saved (Slurm signals every process
of the job step, the worker included). :meth:`StopRequest.held` blocks the signals while the worker
is spawned: a child inherits the blocked mask across exec, so the worker never receives them, and
it still dies with its rank (its parent-death signal is SIGKILL). Signals that reach the rank
meanwhile stay pending and are handled when the block ends.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Whether this rank has been asked to stop, and the all-ranks agreement on it."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @classmethod
    def install(cls) -> StopRequest:
        """Handle SIGTERM and SIGUSR1 in this process from now on (call on the main thread)."""
        request = cls()
        for sig in STOP_SIGNALS:
            signal.signal(sig, request._handle)
        return request

    def _handle(self, signum: int, _frame: object) -> None:
        # No printing here: the handler may interrupt a write to the same stream (reentrant call error).
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    @contextmanager
    def held(self) -> Iterator[None]:
        """Block the stop signals on this thread (and in children started meanwhile); see the module doc."""
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def agreed(self, group: dist.ProcessGroup) -> bool:
        """True on every rank if any rank has been asked to stop (collective over ``group``)."""
        flag = torch.tensor([0 if self.signal_name is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and self.signal_name is not None:
            print(f"[rlrun] {self.signal_name} received: checkpointing and stopping after this step", flush=True)
        return bool(flag.item())
