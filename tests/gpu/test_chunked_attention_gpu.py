"""The chunked kernels (rlrun.kernels.chunked_attention) on the GPU, bf16: the engine's split decode and its prefill
over the
cache are bitwise the trainer's forward (each side at its own tile height), the forward agrees with an fp32 reference,
and its gradients (FlashAttention-2's backward fed the forward's log-sum-exp) with the reference's.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_chunked_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from rlrun.kernels import attention as attention_kernel

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from rlrun.kernels import chunked_attention  # noqa: E402  (Triton: CUDA machines only)

LENGTHS = [700, 1, 129, 640, 768, 64, 300, 511]
"""Samples of a packed row, each ending on, before or after a chunk (256) and tile (64, 16) boundary."""


def _packed(heads: int, kv_heads: int, dim: int, requires_grad: bool = False, lengths: list[int] = LENGTHS):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    q = (torch.randn(total, heads, dim, device="cuda", generator=gen) * 0.5).bfloat16()
    k = (torch.randn(total, kv_heads, dim, device="cuda", generator=gen) * 0.5).bfloat16()
    v = torch.randn(total, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return [t.requires_grad_(requires_grad) for t in (q, k, v)], bounds


def _cache(k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, max_len: int):
    """Each sample's keys and values as a row of the engine's [rows, kv_heads, max_len, dim] buffers."""
    rows, kv_heads, dim = len(bounds) - 1, k.shape[1], k.shape[2]
    cache_k, cache_v = (torch.zeros(rows, kv_heads, max_len, dim, device="cuda", dtype=k.dtype) for _ in range(2))
    for row, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
        cache_k[row, :, : b - a], cache_v[row, :, : b - a] = k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)
    return cache_k, cache_v


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 8, 128), (32, 8, 128), (9, 3, 64), (32, 1, 64)])
def test_the_split_decode_is_bitwise_the_trainers_forward(heads, kv_heads, dim):
    (q, k, v), bounds = _packed(heads, kv_heads, dim)
    scale = dim**-0.5
    trained = attention_kernel.chunked_varlen(q, k, v, bounds, max(LENGTHS), scale)
    cache_k, cache_v = _cache(k, v, bounds, 1024)
    last = bounds[1:].long() - 1
    counts = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    for take in (len(LENGTHS), 4):  # the whole batch, and a shrunk tail's first rows (views of the same buffers)
        got = chunked_attention.decode(q[last[:take]], cache_k[:take], cache_v[:take], counts[:take], scale)
        want = trained[last[:take]]
        assert torch.equal(got, want), f"{(got != want).sum()} of {want.numel()} elements differ from the trainer's"


def test_many_long_rows_decode_bitwise_the_trainers_forward():
    """64 rows of up to 1,500 keys at Qwen3-4B's heads: where a decode tile 16 rows high (the forward's 64) had 1-2 of
    262,144 outputs off (benchmarks/results/exact_split_decode_rlrun_h200.json), so a rare rounding shows."""
    lengths = torch.randint(1, 1501, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    heads, kv_heads, dim = 32, 8, 128
    (q, k, v), bounds = _packed(heads, kv_heads, dim, lengths=lengths)
    trained = attention_kernel.chunked_varlen(q, k, v, bounds, max(lengths), dim**-0.5)
    cache_k, cache_v = _cache(k, v, bounds, 1536)
    last = bounds[1:].long() - 1
    counts = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    got = chunked_attention.decode(q[last], cache_k, cache_v, counts, dim**-0.5)
    assert torch.equal(got, trained[last]), f"{(got != trained[last]).sum()} elements differ from the trainer's"


def test_a_captured_decode_replayed_stays_bitwise_and_leaves_its_counters_zero():
    """The engine replays its captured step: the decode's last-arriving program merges and zeroes its row's counter,
    so every replay (and a decode of other rows between them) must give the forward's rows again."""
    (q, k, v), bounds = _packed(16, 8, 128)
    trained = attention_kernel.chunked_varlen(q, k, v, bounds, max(LENGTHS), 128**-0.5)
    cache_k, cache_v = _cache(k, v, bounds, 1024)
    last = bounds[1:].long() - 1
    query, counts = q[last].contiguous(), torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chunked_attention.decode(query, cache_k, cache_v, counts, 128**-0.5)  # compiles, allocates the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chunked_attention.decode(query, cache_k, cache_v, counts, 128**-0.5)
    for replay in range(20):
        got.zero_()
        graph.replay()
        if replay == 10:
            chunked_attention.decode(query[:3], cache_k[:3], cache_v[:3], counts[:3], 128**-0.5)
        torch.cuda.synchronize()
        assert torch.equal(got, trained[last]), f"replay {replay}: {(got != trained[last]).sum()} elements differ"
    assert not chunked_attention._ARRIVALS[query.device][-1].any()


def test_the_kernels_take_at_most_a_tiles_groups():
    q = torch.zeros(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    assert attention_kernel.chunked_kernel_takes(q, q, attention_kernel.CHUNKED_MAX_GROUPS)
    assert not attention_kernel.chunked_kernel_takes(q, q, attention_kernel.CHUNKED_MAX_GROUPS + 1)
    assert attention_kernel.CHUNKED_MAX_GROUPS <= chunked_attention.BLOCK_M


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 8, 128), (9, 3, 64)])
def test_a_prefill_over_the_cache_in_chunks_is_bitwise_the_trainers_forward(heads, kv_heads, dim):
    (q, k, v), bounds = _packed(heads, kv_heads, dim)
    trained = attention_kernel.chunked_varlen(q, k, v, bounds, max(LENGTHS), dim**-0.5)
    cache_k, cache_v = _cache(k, v, bounds, 768)
    width, rows = 768, len(LENGTHS)
    queries = torch.zeros(rows, heads, width, dim, device="cuda", dtype=q.dtype)  # right-padded, as the engine's
    for row, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)):
        queries[row, :, : b - a] = q[a:b].transpose(0, 1)
    for start, stop in ((0, width), (0, 200), (200, 457), (457, width)):  # one forward, and column chunks
        n = stop - start
        zeros = torch.zeros(rows, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, n, heads, dim, device="cuda", dtype=q.dtype)
        chunked_attention.causal(
            queries[:, :, start:stop].transpose(1, 2),
            cache_k.transpose(1, 2),
            cache_v.transpose(1, 2),
            out,
            (zeros, zeros, zeros + n, zeros + start),
            n,
            dim**-0.5,
        )
        for row, (a, length) in enumerate(zip(bounds[:-1].tolist(), LENGTHS, strict=True)):
            real = slice(start, min(stop, length))  # the prompt's own positions in this chunk
            if real.start < real.stop:
                got = out[row, : real.stop - real.start]
                assert torch.equal(got, trained[a + real.start : a + real.stop]), (row, start, stop)


def _reference(q, k, v, bounds):
    """fp32 causal attention per sample, grouped heads repeated."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


def test_the_forward_and_its_gradients_agree_with_fp32():
    heads, kv_heads, dim = 16, 8, 128
    (q, k, v), bounds = _packed(heads, kv_heads, dim, requires_grad=True)
    out = attention_kernel.chunked_varlen(q, k, v, bounds, max(LENGTHS), dim**-0.5)
    with torch.no_grad():  # the forward without autograd (the engine's, the trainer's log-prob pass) is the same
        assert torch.equal(out, attention_kernel.chunked_varlen(q, k, v, bounds, max(LENGTHS), dim**-0.5))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = _reference(*leaves, bounds)
    want = torch.autograd.grad(reference, leaves, grad.float())
    assert (out.float() - reference).abs().max() < 2e-2
    for name, g, w in zip("qkv", got, want, strict=True):
        error = (g.float() - w).norm() / w.norm()
        assert error < 1e-2, f"d{name}: relative error {error:.2e}"
