"""Flattened-bucket payloads: bit-exact round trips, SGLang's unpickling allowlist, bucketing."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from rlrun.engine.payload import deserialize_flattened_bucket, iter_buckets, serialize_flattened_bucket


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(5, 3, generator=g)),
        ("b.bf16", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.fp16_transposed", torch.randn(4, 6, generator=g).half().t()),  # non-contiguous
        ("d.int64", torch.randint(-(2**40), 2**40, (3, 2), generator=g)),
        ("e.bool", torch.rand(9, generator=g) > 0.5),
        ("f.scalar", torch.tensor(3.25, dtype=torch.float64)),
        ("g.rows_of_a_fused_weight", torch.randn(12, 4, generator=g).reshape(3, 4, 4)[:, 1:3].reshape(-1, 4)),
        ("h.strided_rows", torch.randn(8, 6, generator=g).to(torch.bfloat16)[::2]),  # a view with gaps
    ]


def test_round_trip_is_bit_exact_for_mixed_dtypes():
    tensors = _mixed_tensors()
    restored = deserialize_flattened_bucket(serialize_flattened_bucket(tensors))
    assert [n for n, _ in restored] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, restored, strict=False):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_metadata_counts_bytes_like_sglang_flattened_tensor_bucket():
    tensors = _mixed_tensors()
    bucket = pickle.loads(serialize_flattened_bucket(tensors))  # plain pickle: inspect the raw structure
    offset = 0
    for (name, tensor), meta in zip(tensors, bucket["metadata"], strict=False):
        nbytes = tensor.numel() * tensor.element_size()
        offset += -offset % 16  # aligned starts, so the receiver can view each slice as its dtype
        assert (meta.name, meta.shape, meta.dtype) == (name, tensor.shape, tensor.dtype)
        assert (meta.start_idx, meta.end_idx, meta.numel) == (offset, offset + nbytes, nbytes)
        offset += nbytes
    assert bucket["flattened_tensor"].dtype == torch.uint8 and bucket["flattened_tensor"].numel() == offset


def test_the_flat_buffer_is_its_own_copy_with_zeroed_padding():
    tensors = _mixed_tensors()
    bucket = pickle.loads(serialize_flattened_bucket(tensors))
    flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
    padding = torch.ones(flat.numel(), dtype=torch.bool)
    for meta in metadata:
        padding[meta.start_idx : meta.end_idx] = False
    assert padding.any(), "the mixed tensors must need alignment padding for this test to check it"
    assert not flat[padding].any()
    before = flat.clone()
    for _, tensor in tensors:
        tensor.zero_() if tensor.dtype != torch.bool else tensor.logical_not_()
    assert torch.equal(flat, before), "the payload must not alias the tensors it was packed from"


@dataclasses.dataclass
class OwnMetadata:
    """A metadata class defined outside SGLang's allowlist, as an rlrun type would be."""

    name: str


class Gadget:
    def __reduce__(self):
        return (os.system, ("echo should-never-run",))


@pytest.mark.parametrize(
    "foreign, blocked",
    [
        (OwnMetadata("x"), f"{__name__}.OwnMetadata"),
        (Gadget(), "system"),
    ],
)
def test_non_allowlisted_global_is_blocked(foreign, blocked):
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [foreign]})
    payload = buf.getvalue()
    with pytest.raises(RuntimeError, match=r"Blocked unsafe global \(.*" + blocked.split(".")[-1]):
        deserialize_flattened_bucket(payload)


def test_iter_buckets_keeps_order_and_respects_the_limit():
    sizes = [10, 30, 25, 100, 5, 5, 60, 1]
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    limit = 50
    buckets = list(iter_buckets(iter(tensors), limit))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for i, bucket in enumerate(buckets):
        total = sum(t.numel() for _, t in bucket)
        assert total <= limit or len(bucket) == 1  # only a lone oversized tensor may exceed the limit
        if i + 1 < len(buckets):  # greedy: the next tensor would not have fitted
            assert total + buckets[i + 1][0][1].numel() > limit


def test_iter_buckets_rejects_a_non_positive_size():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([("x", torch.zeros(1))], 0))
