"""Run a function on N real processes, as torchrun would, and bring back its results.

``fn`` must be a top-level (picklable) function. Each process gets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT, one torch thread, and runs ``fn(*args)``; it is
``fn``'s job to call ``init_distributed``. Results travel as pickled bytes (tensors are copied, so a
process may exit before the parent reads its result).
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from rlrun.runtime.dist import free_port


def _worker(fn: Callable, rank: int, world_size: int, port: int, results, args: tuple) -> None:
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
    import torch

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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, results, args), daemon=True)
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
