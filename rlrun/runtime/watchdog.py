"""End every rank within seconds when any rank or engine worker dies, with one message naming it.

Without this, a rank lost to the OOM killer, a dead node or a crashed engine worker leaves the other
ranks blocked in a collective until its timeout (NCCL: the process-group timeout, minutes), holding
their GPUs. torchrun does notice a dead *local* rank and SIGTERMs its siblings, but not a dead node
or a dead engine worker (a grandchild), and SIGTERM already means "checkpoint and stop"
(rlrun/runtime/preemption.py), so it cannot also mean "abort".

Every rank runs one daemon thread with its own client of the rendezvous TCPStore (torchrun's agent
store; rank 0's outside torchrun). Every ``INTERVAL_S`` it::

    adds 1 to   beat/<rank>                  its heartbeat
    reads       abort                        a failure someone published -> print it, exit
    polls       its own engine workers       exited -> publish, exit (the engine, and the OPD teacher engine)
    checks      its torchrun agent           gone (a new parent pid) -> publish, exit: a killed agent leaves
                                             its ranks running, and the other nodes' agents would wait for it
    checks      its ring neighbour rank+1    same host: is the pid alive?  any host: has its beat
                                             moved within PEER_TIMEOUT_S?   gone -> publish, exit

A failure is published once (first writer wins) as one line naming rank, pid, host, step and cause;
every rank prints it and exits with ``EXIT_PEER_FAILED`` within about one interval, and each
rank's engine worker dies with it. Watching one neighbour keeps store traffic O(world size).

When the main thread's step fails (:meth:`Watchdog.fail`), a communication error is first blamed on
a dead peer if the watcher finds one; any other error is published as this rank's own failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from rlrun.runtime.deaths import WatchedProcess
from rlrun.runtime.dist import Parallel
from rlrun.runtime.processes import process_alive

INTERVAL_S = 1.0
PEER_TIMEOUT_S = 15.0
"""A peer on another host is declared dead after this long without a heartbeat: long enough for a
process descheduled on a busy machine, short enough that every rank is gone within 30 s."""
STORE_TIMEOUT_S = 10.0
EXIT_PEER_FAILED = 43


@dataclass(frozen=True)
class WatchedWorker:
    """A worker process of this rank whose exit is this rank's failure."""

    role: str
    """How messages name it: "engine", "teacher engine"."""
    watched: WatchedProcess


@dataclass(frozen=True)
class PeerInfo:
    rank: int
    pid: int
    host: str
    role: str = "rank"
    """How messages name the rank: "rank", or "engine rank" (``placement.engine_ranks``)."""

    def describe(self) -> str:
        return f"{self.role} {self.rank} (pid {self.pid} on {self.host})"


def is_peer_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer went away (gloo raises a plain
    RuntimeError from its TCP transport; NCCL and the store raise DistError)."""
    return isinstance(exc, dist.DistError) or "gloo/transport" in str(exc)


class Watchdog:
    """This rank's heartbeat and failure watcher; see the module docstring."""

    def __init__(self, me: PeerInfo, world_size: int, store: dist.Store, store_addr: str, prefix: str) -> None:
        self.me = me
        self.world_size = world_size
        self.step = 0
        """The loop's current step, for messages (written by the main thread)."""
        self.phase = "setup"
        """The main thread's phase (a step's phases, ``checkpoint``), for messages; see :meth:`phase_started`."""
        # The store client belongs to the watcher thread while it runs, to the main thread otherwise.
        self._store = store
        self._store_addr = store_addr
        self._prefix = prefix
        self._store_ok_s = time.monotonic()
        self._workers: list[WatchedWorker] = []
        self._agent_pid: int | None = None
        """The torchrun agent that started this rank (None: not under torchrun)."""
        self._neighbour = (me.rank + 1) % world_size
        self._neighbour_info: PeerInfo | None = None
        self._neighbour_beats = -1
        self._neighbour_seen_s = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlrun-watchdog", daemon=True)

    @classmethod
    def start(cls, parallel: Parallel, role: str = "rank") -> Watchdog:
        """Watch this rank among all of torchrun's ranks (training and engine ranks alike)."""
        env = parallel.env
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
        )
        # A torchrun restart reuses the agent's store: keys of an earlier attempt must not leak in.
        attempt = (
            f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        )
        me = PeerInfo(rank=parallel.rank, pid=os.getpid(), host=socket.gethostname(), role=role)
        watchdog = cls(me, env.world_size, store, f"{env.master_addr}:{env.master_port}", f"rlrun-watchdog/{attempt}/")
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            watchdog._agent_pid = os.getppid()
        store.set(watchdog._key("peer", me.rank), json.dumps(asdict(me)))
        watchdog._thread.start()
        return watchdog

    def watch_engine(self, watched: WatchedProcess | None, role: str = "engine") -> None:
        """Also treat the exit of this rank's ``role`` worker as a failure of this rank (None: this rank has
        none, a member of an engine group)."""
        if watched is not None:
            self._workers.append(WatchedWorker(role, watched))

    def phase_started(self, phase: str) -> None:
        """The main thread enters ``phase`` (a ``PhaseTimer`` listener): failures found from now on name it, so a
        rank that waits at a collective for a dead or stuck peer says what it was doing."""
        self.phase = phase

    def where(self) -> str:
        return f"step {self.step} ({self.phase})"

    def close(self, group: dist.ProcessGroup | None) -> None:
        """Normal end: stop watching, then wait for every rank of ``group`` to stop (so no rank exits while
        watched; None: an engine rank, which rank 0 stops after the trainers' end)."""
        self._stop_thread()
        self._store.set(self._key("done", self.me.rank), "1")
        if group is not None:
            dist.barrier(group=group)

    def fail(self, exc: BaseException) -> None:
        """The main thread is failing with ``exc``: blame a dead peer if that is the cause (the watcher
        then exits this process), else publish ``exc`` as this rank's failure and return."""
        if is_peer_error(exc):
            time.sleep(PEER_TIMEOUT_S + 2 * INTERVAL_S)
        self._stop_thread()
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        try:
            self._publish(f"{self.me.describe()} failed at {self.where()}: {type(exc).__name__}: {first_line}")
        except Exception as store_exc:  # noqa: BLE001 - the original error propagates; this is only a note
            print(
                f"[rlrun] {self.me.describe()} could not publish its failure: {store_exc}", file=sys.stderr, flush=True
            )

    # ---- the watcher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                verdict = self._tick()
                self._store_ok_s = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - store unreachable: retried until PEER_TIMEOUT_S
                if time.monotonic() - self._store_ok_s < PEER_TIMEOUT_S:
                    continue
                verdict = (
                    f"the rendezvous store at {self._store_addr} has been unreachable for "
                    f"{PEER_TIMEOUT_S:.0f} s ({exc}): torchrun on the first node (or rank 0 without "
                    f"torchrun) is gone"
                )
            if verdict is not None and not self._stop.is_set():
                self._exit(verdict)

    def _tick(self) -> str | None:
        self._store.add(self._key("beat", self.me.rank), 1)
        if self._store.check([self._key("abort")]):
            return self._store.get(self._key("abort")).decode()
        cause = self._engine_death() or self._agent_death() or self._neighbour_death()
        return self._publish(cause) if cause else None

    def _engine_death(self) -> str | None:
        for worker in self._workers:
            how = worker.watched.exit_note()
            if how is None:
                continue
            return (
                f"the {worker.role} worker of {self.me.describe()} (pid {worker.watched.process.pid}) {how} at "
                f"{self.where()}; see {worker.watched.log_path}"
            )
        return None

    def _agent_death(self) -> str | None:
        """This rank's torchrun agent is gone: its parent changed (the orphan was re-parented)."""
        if self._agent_pid is None or os.getppid() == self._agent_pid:
            return None
        node = os.environ.get("GROUP_RANK", "?")
        return (
            f"the torchrun agent of node {node} (pid {self._agent_pid} on {self.me.host}) is gone, leaving "
            f"{self.me.describe()} without its node at {self.where()}: the node died or its agent was killed"
        )

    def _neighbour_death(self) -> str | None:
        if self.world_size == 1 or self._store.check([self._key("done", self._neighbour)]):
            return None
        if self._neighbour_info is None and self._store.check([self._key("peer", self._neighbour)]):
            self._neighbour_info = PeerInfo(**json.loads(self._store.get(self._key("peer", self._neighbour))))
        info = self._neighbour_info
        who = info.describe() if info else f"rank {self._neighbour}"
        if info is not None and info.host == self.me.host and not process_alive(info.pid):
            return f"{who} died: its process is gone (killed or crashed; see its output) at {self.where()}"
        beats, now = self._store.add(self._key("beat", self._neighbour), 0), time.monotonic()
        if beats != self._neighbour_beats:
            self._neighbour_beats, self._neighbour_seen_s = beats, now
        if now - self._neighbour_seen_s > PEER_TIMEOUT_S:
            return (
                f"{who} sent no heartbeat for {PEER_TIMEOUT_S:.0f} s at {self.where()}: its process or "
                f"node is gone, or it is stuck without releasing the Python GIL"
            )
        return None

    def _publish(self, cause: str) -> str:
        """Record ``cause`` as the run's failure unless one is recorded already; returns the recorded one."""
        return self._store.compare_set(self._key("abort"), "", cause).decode()

    def _exit(self, verdict: str) -> None:
        print(f"[rlrun] {self.me.describe()} exiting: {verdict}", file=sys.stderr, flush=True)
        for process in (worker.watched.process for worker in self._workers):
            if process.poll() is not None:
                continue
            try:  # the worker leads its own process group (SGLang's schedulers live in it too)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                process.kill()
        os._exit(EXIT_PEER_FAILED)

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _key(self, kind: str, rank: int | None = None) -> str:
        return f"{self._prefix}{kind}" if rank is None else f"{self._prefix}{kind}/{rank}"
