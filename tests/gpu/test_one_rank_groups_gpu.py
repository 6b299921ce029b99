"""One-rank NCCL groups answer their collectives without a communicator (rlrun/runtime/one_rank_collectives.py).

The reference is the driver's free-memory count: a plain one-rank NCCL group's first collective creates a
communicator of ~0.41 GB (benchmarks/results/nccl_comm_memory_h200.json), the reloadable wrapper's must create
none, and NCCL's own sequence number (what ``one_rank_groups_with_communicator`` reads) must count the plain
group's collective and none of the wrapper's.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _used_bytes() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def _worker() -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from rlrun.runtime import reloadable_groups
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    init_distributed(tp=1, pp=1, seed=0, reloadable_backends=("nccl",))
    wrapped, plain = dist.new_group([0]), reloadable_groups._original_new_group([0])
    source = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    summed, reference, gathered = source.clone(), source.clone(), torch.empty_like(source)
    buckets = [source.clone(), 2 * source]
    start = _used_bytes()  # every tensor exists: what follows can only add NCCL's memory
    dist.all_reduce(summed, group=wrapped)
    with _coalescing_manager(wrapped, async_ops=True) as cm:
        for bucket in buckets:
            dist.all_reduce(bucket, group=wrapped, async_op=True)
    cm.wait()
    dist.all_gather_into_tensor(gathered, source, group=wrapped)
    dist.barrier(group=wrapped)
    after_wrapped = _used_bytes()
    dist.all_reduce(reference, group=plain)
    after_plain = _used_bytes()
    out = {
        "wrapped_gb": (after_wrapped - start) / 1e9,
        "plain_gb": (after_plain - after_wrapped) / 1e9,
        "wrapped_seq": wrapped.inner._get_sequence_number_for_group(),
        "plain_seq": plain._get_sequence_number_for_group(),
        "with_communicator": reloadable_groups.one_rank_groups_with_communicator(),
        "equal": torch.equal(summed, reference)
        and torch.equal(torch.cat(buckets), torch.cat([source, 2 * source]))
        and torch.equal(gathered, source),
    }
    destroy_distributed()
    return out


def test_one_rank_nccl_group_never_creates_a_communicator():
    out = run_distributed(_worker, 1)
    assert out["equal"], out
    assert out["wrapped_seq"] == 0 and out["with_communicator"] == 0, out
    assert out["plain_seq"] > 0, out  # the count the offloader's metric reads does see a real NCCL collective
    assert out["wrapped_gb"] < 0.05, out
    assert out["plain_gb"] > 0.2, out  # the communicator the wrapper avoided (0.41 GB measured on the H200)
