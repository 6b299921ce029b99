"""Rollout data between ranks (rlrun/data/transfer.py) on real gloo worlds of one and two processes."""

from __future__ import annotations

from dist_utils import run_distributed


def _scatter_worker() -> dict:
    import torch.distributed as dist

    from rlrun.data.transfer import scatter_from_rank0

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sent = [{"rank": r, "rows": list(range(r + 3))} for r in range(world)] if rank == 0 else None
    got = scatter_from_rank0(sent)
    out = {"got": got, "same_object": sent is not None and got is sent[0]}
    dist.destroy_process_group()
    return out


def test_scatter_gives_each_rank_its_object_and_one_rank_its_own_without_a_copy():
    one = run_distributed(_scatter_worker, 1)
    assert one == {"got": {"rank": 0, "rows": [0, 1, 2]}, "same_object": True}  # no pickle round trip on one rank
    two = run_distributed(_scatter_worker, 2, all_ranks=True)
    assert [r["got"] for r in two] == [{"rank": 0, "rows": [0, 1, 2]}, {"rank": 1, "rows": [0, 1, 2, 3]}]
    assert [r["same_object"] for r in two] == [False, False]  # two ranks: rank 0's own arrives unpickled too
