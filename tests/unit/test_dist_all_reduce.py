"""rlrun.runtime.dist.all_reduce: the identity on a one-rank group without a collective (which, after
the offloader's NCCL teardown, would create a communicator each step), a real sum otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlrun.runtime.dist import all_reduce, free_port


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: (calls.append(kwargs.get("group")), real(*args, **kwargs))[1]
    own = [dist.new_group([r]) for r in range(2)][rank]  # every rank creates every group, keeps its own
    both = torch.tensor([rank + 1.0])
    alone = torch.tensor([rank + 1.0])
    all_reduce(both, dist.group.WORLD)
    all_reduce(alone, own, op=dist.ReduceOp.MAX)
    out.put((rank, both.item(), alone.item(), len(calls)))
    dist.destroy_process_group()


def test_all_reduce_sums_over_two_ranks_and_skips_a_group_of_one():
    port, ctx = free_port(), mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert results == [(0, 3.0, 1.0, 1), (1, 3.0, 2.0, 1)]  # one collective each: the world's
