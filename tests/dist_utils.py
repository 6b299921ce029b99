"""Run a function on N real processes, as torchrun would, and bring back its results.

``fn`` must be a top-level (picklable) function. Each process gets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT, one torch thread, and runs ``fn(*args)``; it is
``fn``'s job to call ``init_distributed``. Results travel as pickled bytes (tensors are copied, so a
process may exit before the parent reads its result).

Without CUDA the processes are forked from a multiprocessing forkserver that imported torch, Megatron and
transformers once per test process (``PRELOAD``): these imports are most of a rank's start-up CPU, and the
CPU suite starts many ranks. The server holds nothing else (no process group, no model), so every rank still
starts from the same clean state; each gets the parent's current environment. With CUDA: spawn, as a forked
process must not inherit a CUDA context.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from rlrun.runtime.dist import free_port

PRELOAD = [
    "torch",
    "transformers",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
    "rlrun.megatron",
    "rlrun.megatron.model",
    "rlrun.engine.client",
    "rlrun.runtime.dist",
]


def _context():
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first run here)
    return ctx


def _worker(fn: Callable, rank: int, world_size: int, port: int, results, args: tuple, env: dict) -> None:
    os.environ.clear()  # the forkserver's environment is the one it started with
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    torch.set_num_threads(1)
    try:
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank, then re-raised there
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300, all_ranks: bool = False) -> Any:
    """Run ``fn(*args)`` on ``world_size`` processes; rank 0's return value (or all, by rank).

    The first failing rank's traceback is raised as ``RuntimeError`` naming the rank; the other
    processes are then terminated (only the ones started here). A run longer than ``timeout_s`` raises
    ``TimeoutError`` naming the ranks that never reported.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args, dict(os.environ)), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                _check_alive(procs, values, deadline, timeout_s, fn.__name__)
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(values) == world_size else 0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return [values[rank] for rank in range(world_size)] if all_ranks else values[0]


def _check_alive(procs: list, values: dict, deadline: float, timeout_s: float, name: str) -> None:
    """Raise when a rank died without reporting (killed, segfault) or the run is past its deadline."""
    missing = [rank for rank in range(len(procs)) if rank not in values]
    for rank in missing:
        exitcode = procs[rank].exitcode
        if exitcode is not None and exitcode != 0:
            raise RuntimeError(
                f"rank {rank} of {len(procs)} exited with code {exitcode} in {name} "
                f"without reporting a result or an exception"
            )
    if time.monotonic() > deadline:
        raise TimeoutError(f"ranks {missing} did not finish {name} within {timeout_s} s")
