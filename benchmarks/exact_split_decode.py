"""Exact split-KV decode: a trainer forward and a decode kernel that sum each query row's keys in the same chunks.

Why (issue 29; docs/engine.md, "Where SGLang's remaining lead is"): the embedded engine's decode attention is the
trainer's memory-efficient kernel, one thread block per (row, cached head) walking the row's keys in order, at
1.6-2.6 TB/s on the H200 (benchmarks/decode_attention.py). A split-KV decode (a row's keys over several blocks, the
parts merged) keeps the GPU busier, but its sums round differently from a trainer that walks the keys in one pass.
This tries the pair that could be exact: both kernels split each row's keys into chunks of ``CHUNK`` keys from key
0, run the same online softmax over a chunk (one jit function, the same tile shapes: ``BLOCK_M`` query rows, each of
``BLOCK_MS`` tried, and ``BLOCK_N`` keys), and merge the chunks in order with one formula; the trainer walks its
chunks in a loop, the decode computes them in parallel (``_decode_partials``) and merges them after
(``_decode_merge``). A decode tile holds the G query heads of one cached head, padded to ``BLOCK_M`` rows.

Measured (GPU): whether the decode rows are bitwise the trainer's rows (a sample's last positions, per chunk
size); the decode's time against ``attention_kernel.decode`` (the engine's path) at batch 64 and 128 and 256-2,048
keys; the trainer forward's time against the memory-efficient varlen forward at training shapes. With
``TRITON_INTERPRET=1`` on CPU it checks only the kernels' logic (both close to an fp32 reference, in fp32): the
interpreter's matmul is numpy's, whose rounding of a row depends on its place in the tile, so bitwise equality of the
two is a GPU question; measured there in bf16.

    python3 benchmarks/exact_split_decode.py --out benchmarks/results/exact_split_decode_h200.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from decode_attention import emit, graph_timed_us  # benchmarks/, the script's folder

BLOCK_MS = (16, 64)
"""Query rows a tile (the G heads of a decode's cached head, padded), tried both ways: the same on both sides, so
that each row's products go through the same matrix instructions (16: less padding in a decode tile; 64: fewer K/V
reads in the trainer's)."""
BLOCK_N = 64
"""Keys per inner step of a chunk."""
WARPS = 4
STAGES = 2


@triton.jit
def _chunk_partial(q, k_base, v_base, stride_kn, stride_vn, start, stop, limit, scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """One chunk's online softmax for a tile of query rows: keys [start, stop), row i seeing keys <= limit[i]
    (-1: a padding row, which stays at -inf / 0 / 0)."""
    offs_d = tl.arange(0, HEAD)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        inside = offs_n < stop
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(inside[None, :] & (offs_n[None, :] <= limit[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, l, acc


@triton.jit
def _merge(big_m, big_l, big_acc, m, l, acc):  # noqa: E741
    """Chunk (m, l, acc) into the running (M, L, ACC), in chunk order on both sides."""
    m_new = tl.maximum(big_m, m)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(big_m - m_safe)
    b = tl.exp(m - m_safe)
    return m_new, big_l * a + l * b, big_acc * a[:, None] + acc * b[:, None]


@triton.jit
def _train_forward(q_ptr, k_ptr, v_ptr, out_ptr, length, scale,
                   stride_qs, stride_qt, stride_qh, stride_ks, stride_kt, stride_kh,
                   stride_vs, stride_vt, stride_vh, stride_os, stride_ot, stride_oh,
                   GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD: tl.constexpr):  # fmt: skip
    """Causal attention over samples of ``length`` tokens ([S, T, heads, dim]): a tile of BLOCK_M positions of one
    head walks its chunks in order."""
    block, head, sample = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    rows = offs_m < length
    q = tl.load(
        q_ptr + sample * stride_qs + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=rows[:, None],
        other=0.0,
    )
    limit = tl.where(rows, offs_m, -1)
    k_base = k_ptr + sample * stride_ks + (head // GROUPS) * stride_kh
    v_base = v_ptr + sample * stride_vs + (head // GROUPS) * stride_vh
    big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_M], tl.float32)
    big_acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    last = tl.minimum(block * BLOCK_M + BLOCK_M, length)
    for start in range(0, last, CHUNK):
        m, l, acc = _chunk_partial(  # noqa: E741
            q, k_base, v_base, stride_kt, stride_vt, start, tl.minimum(start + CHUNK, length), limit, scale,
            BLOCK_M, BLOCK_N, HEAD,
        )  # fmt: skip
        big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc)
    out = big_acc / big_l[:, None]
    tl.store(
        out_ptr + sample * stride_os + offs_m[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rows[:, None],
    )


@triton.jit
def _decode_partials(q_ptr, k_ptr, v_ptr, counts_ptr, part_m, part_l, part_acc, scale,
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                     CHUNKS, GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD: tl.constexpr):  # fmt: skip
    """Chunk c of row b's keys for the G query heads of cached head j: its (m, l, acc) into the part buffers
    ([B, H_kv, CHUNKS, BLOCK_M(, HEAD)])."""
    row, kv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + row)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    heads = offs_m < GROUPS
    q = tl.load(
        q_ptr + row * stride_qb + (kv * GROUPS + offs_m)[:, None] * stride_qh + offs_d[None, :],
        mask=heads[:, None],
        other=0.0,
    )
    limit = tl.where(heads, count - 1, -1)
    start = chunk * CHUNK
    m, l, acc = _chunk_partial(  # noqa: E741
        q, k_ptr + row * stride_kb + kv * stride_kh, v_ptr + row * stride_vb + kv * stride_vh, stride_kn, stride_vn,
        start, tl.minimum(start + CHUNK, count), limit, scale, BLOCK_M, BLOCK_N, HEAD,
    )  # fmt: skip
    at = (row * tl.num_programs(1) + kv) * CHUNKS + chunk
    tl.store(part_m + at * BLOCK_M + offs_m, m)
    tl.store(part_l + at * BLOCK_M + offs_m, l)
    tl.store(part_acc + (at * BLOCK_M + offs_m)[:, None] * HEAD + offs_d[None, :], acc)


@triton.jit
def _decode_merge(part_m, part_l, part_acc, counts_ptr, out_ptr, stride_ob, stride_oh,
                  CHUNKS, GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                  HEAD: tl.constexpr):  # fmt: skip
    """Row b's chunks for cached head j merged in order; its G heads' outputs stored."""
    row, kv = tl.program_id(0), tl.program_id(1)
    count = tl.load(counts_ptr + row)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    big_l = tl.zeros([BLOCK_M], tl.float32)
    big_acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    for chunk in range(0, tl.cdiv(count, CHUNK)):
        at = (row * tl.num_programs(1) + kv) * CHUNKS + chunk
        m = tl.load(part_m + at * BLOCK_M + offs_m)
        l = tl.load(part_l + at * BLOCK_M + offs_m)  # noqa: E741
        acc = tl.load(part_acc + (at * BLOCK_M + offs_m)[:, None] * HEAD + offs_d[None, :])
        big_m, big_l, big_acc = _merge(big_m, big_l, big_acc, m, l, acc)
    heads = offs_m < GROUPS
    out = big_acc / tl.where(heads, big_l, 1.0)[:, None]
    tl.store(
        out_ptr + row * stride_ob + (kv * GROUPS + offs_m)[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=heads[:, None],
    )


def train_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, block_m: int) -> torch.Tensor:
    """Causal attention of ``[S, T, H, D]`` queries over ``[S, T, H_kv, D]`` keys and values."""
    samples, length, heads, dim = q.shape
    out = torch.empty_like(q)
    grid = (triton.cdiv(length, block_m), heads, samples)
    _train_forward[grid](
        q, k, v, out, length, dim**-0.5, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        GROUPS=heads // k.shape[2], CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD=dim,
        num_warps=WARPS, num_stages=STAGES, enable_fp_fusion=False,
    )  # fmt: skip
    return out


class SplitDecode:
    """One decode step's attention: ``[B, H, D]`` queries over a cache ``[B, H_kv, L, D]``, row b reading its first
    ``counts[b]`` columns, in chunks of ``chunk`` (part buffers allocated once, as a captured step would)."""

    def __init__(
        self, rows: int, heads: int, kv_heads: int, max_len: int, dim: int, chunk: int, block_m: int, device
    ) -> None:
        self.chunks = triton.cdiv(max_len, chunk)
        self.chunk, self.groups, self.dim, self.block_m = chunk, heads // kv_heads, dim, block_m
        parts = rows * kv_heads * self.chunks * block_m
        self.part_m = torch.empty(parts, dtype=torch.float32, device=device)
        self.part_l = torch.empty(parts, dtype=torch.float32, device=device)
        self.part_acc = torch.empty(parts * dim, dtype=torch.float32, device=device)

    def __call__(self, q, k, v, counts) -> torch.Tensor:
        rows, kv_heads = k.shape[0], k.shape[1]
        out = torch.empty_like(q)
        _decode_partials[(rows, kv_heads, self.chunks)](
            q, k, v, counts, self.part_m, self.part_l, self.part_acc, self.dim**-0.5, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), CHUNKS=self.chunks,
            GROUPS=self.groups, CHUNK=self.chunk, BLOCK_M=self.block_m, BLOCK_N=BLOCK_N, HEAD=self.dim,
            num_warps=WARPS, num_stages=STAGES, enable_fp_fusion=False,
        )  # fmt: skip
        _decode_merge[(rows, kv_heads)](
            self.part_m, self.part_l, self.part_acc, counts, out, out.stride(0), out.stride(1), CHUNKS=self.chunks,
            GROUPS=self.groups, CHUNK=self.chunk, BLOCK_M=self.block_m, HEAD=self.dim, num_warps=WARPS,
            enable_fp_fusion=False,
        )  # fmt: skip
        return out


def _reference(q, k, v) -> torch.Tensor:
    """fp32 causal attention of one sample ([T, H, D] queries, [T, H_kv, D] keys/values)."""
    groups = q.shape[1] // k.shape[1]
    q32, k32, v32 = (
        t.float().transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
    )
    return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True).transpose(0, 1)


def exactness(heads: int, kv_heads: int, length: int, rows: int, chunk: int, block_m: int, device, dtype) -> dict:
    """Decode rows at a sample's last ``rows`` positions against the trainer forward's rows, and both against fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = (torch.randn(length, heads, 128, generator=gen, device=device) * 0.5).to(dtype)
    k = (torch.randn(length, kv_heads, 128, generator=gen, device=device) * 0.5).to(dtype)
    v = torch.randn(length, kv_heads, 128, generator=gen, device=device).to(dtype)
    trained = train_forward(q[None], k[None], v[None], chunk, block_m)[0]
    positions = torch.arange(length - rows, length, device=device)
    cache_k = k.transpose(0, 1)[None].expand(rows, -1, -1, -1).contiguous()
    cache_v = v.transpose(0, 1)[None].expand(rows, -1, -1, -1).contiguous()
    counts = (positions + 1).to(torch.int32)
    decoded = SplitDecode(rows, heads, kv_heads, length, 128, chunk, block_m, device)(
        q[positions].contiguous(), cache_k, cache_v, counts
    )
    want = trained[positions]
    reference = _reference(q, k, v)
    return {
        "heads": heads, "kv_heads": kv_heads, "length": length, "rows": rows, "chunk": chunk, "block_m": block_m,
        "elements_differing": int((decoded != want).sum()), "elements": want.numel(),
        "trainer_max_abs_vs_fp32": float((trained.float() - reference).abs().max()),
        "decode_max_abs_vs_fp32": float((decoded.float() - reference[positions]).abs().max()),
    }  # fmt: skip


def decode_speed(batch: int, length: int, chunk: int, block_m: int, iters: int) -> dict:
    """The split decode against the engine's path (``attention_kernel.decode``), Qwen3-0.6B's heads (16, 8, 128)."""
    from rlrun.attention_kernel import DecodeRows, decode, positions_per_row

    heads, kv_heads, dim, device = 16, 8, 128, torch.device("cuda")
    q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, length, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    counts = torch.full((batch,), length, dtype=torch.int32, device=device)
    split = SplitDecode(batch, heads, kv_heads, length, dim, chunk, block_m, device)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device)
    rows = DecodeRows.of(mask, heads // kv_heads, positions_per_row(k))
    query = q[:, :, None]
    return {
        "batch": batch, "length": length, "chunk": chunk, "block_m": block_m,
        "split_us": round(graph_timed_us(lambda: split(q, k, v, counts), iters), 2),
        "engine_us": round(graph_timed_us(lambda: decode(query, k, v, rows), iters), 2),
    }  # fmt: skip


def train_speed(samples: int, length: int, chunk: int, block_m: int, iters: int) -> dict:
    """The trainer forward against the memory-efficient varlen forward (the trainer's now), Qwen3-0.6B's heads."""
    from rlrun import attention_kernel

    heads, kv_heads, dim, device = 16, 8, 128, torch.device("cuda")
    q = torch.randn(samples, length, heads, dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(samples, length, kv_heads, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    bounds = torch.arange(0, (samples + 1) * length, length, dtype=torch.int32, device=device)
    packed = [t.reshape(samples * length, t.shape[2], dim) for t in (q, k, v)]
    flops = 4 * samples * length * length / 2 * heads * dim
    split_us = graph_timed_us(lambda: train_forward(q, k, v, chunk, block_m), iters)
    efficient_us = graph_timed_us(lambda: attention_kernel.efficient_varlen(*packed, bounds, length, dim**-0.5), iters)
    return {
        "samples": samples, "length": length, "chunk": chunk, "block_m": block_m, "split_us": round(split_us, 1),
        "efficient_us": round(efficient_us, 1), "split_tflops": round(flops / split_us / 1e6, 1),
        "efficient_tflops": round(flops / efficient_us / 1e6, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", default="128,256,512")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    record: dict = {"benchmark": "exact_split_decode", "command": "python3 " + " ".join(sys.argv)}
    record["torch"], record["triton"] = torch.__version__, triton.__version__
    record["hardware"] = torch.cuda.get_device_name() if gpu else "cpu (TRITON_INTERPRET=1: logic only)"
    # the interpreter's bf16 matmul is not bf16's, and its fp32 one (numpy's) rounds a row by its place in the tile,
    # so on CPU only the agreement with fp32 says something: fp32 inputs there
    shapes = [(16, 8, 700), (32, 8, 1500)] if gpu else [(4, 2, 200), (8, 2, 150)]
    dtype = torch.bfloat16 if gpu else torch.float32
    record["exactness"] = [
        exactness(h, kv, n, 64 if gpu else 8, c, m, device, dtype)
        for h, kv, n in shapes
        for c in chunks
        for m in BLOCK_MS
    ]
    if gpu:
        record["decode_speed"] = [
            decode_speed(b, n, c, m, args.iters)
            for b in (64, 128)
            for n in (256, 512, 1024, 2048)
            for c in chunks
            for m in BLOCK_MS
        ]
        record["train_speed"] = [
            train_speed(s, n, c, m, 10) for s, n in ((16, 1024), (1, 8192)) for c in chunks for m in BLOCK_MS
        ]
    emit(record, args.out)


if __name__ == "__main__":
    main()
