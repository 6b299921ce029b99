"""Real 2-process groups: Parallel coordinates, the gloo control group, and run_distributed's error path."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _coordinates_worker(tp: int) -> dict:
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=1, seed=0)
    ranks = [None] * parallel.world_size
    dist.all_gather_object(ranks, parallel.rank, group=parallel.cpu_group)
    out = {k: getattr(parallel, k) for k in ("rank", "world_size", "tp_rank", "tp_size", "dp_rank", "dp_size")}
    out.update(is_rank0=parallel.is_rank0, device=str(parallel.device), gathered=ranks)
    destroy_distributed()
    return out


def _fail_on_rank1() -> int:
    import os

    if os.environ["RANK"] == "1":
        raise KeyError("planted failure")
    return int(os.environ["RANK"])


def test_tp2_coordinates_and_control_group():
    ranks = run_distributed(_coordinates_worker, 2, 2, all_ranks=True)
    assert [(r["rank"], r["tp_rank"], r["dp_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0)]
    assert all(r["tp_size"] == 2 and r["dp_size"] == 1 and r["world_size"] == 2 for r in ranks)
    assert [r["is_rank0"] for r in ranks] == [True, False]
    assert all(r["gathered"] == [0, 1] for r in ranks)


def test_a_failing_rank_is_reported_with_its_rank():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed in _fail_on_rank1(.|\n)*planted failure"):
        run_distributed(_fail_on_rank1, 2, timeout_s=60)
