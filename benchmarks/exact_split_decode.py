"""Exact split-KV decode: a trainer forward and a decode kernel that sum each query row's keys in the same chunks.

Why (docs/engine.md, "Where SGLang's remaining lead is"): the embedded engine's decode attention is the
trainer's memory-efficient kernel, one thread block per (row, cached head) walking the row's keys in order, at
1.6-2.6 TB/s on the H200 (benchmarks/decode_attention.py). A split-KV decode (a row's keys over several blocks, the
parts merged) keeps the GPU busier, but its sums round differently from a trainer that walks the keys in one pass.
The pair is rlrun's (``rlrun/kernels/chunked_attention.py``, ``model.packed_attention: chunked_varlen``): both sides
split
each row's keys into chunks of ``CHUNK`` keys from key 0, run the same online softmax over a chunk and merge the
chunks in order with one formula; the forward walks its chunks in a loop, the decode computes them in parallel and
merges them after. Each side's tile height (query rows a tile: the forward's consecutive positions, the decode's G
query heads of one cached head, padded) is tried at 16 and 64, each against each.

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
from decode_attention import emit, graph_timed_us  # benchmarks/, the script's folder

from rlrun.kernels import chunked_attention

BLOCK_MS = (16, 64)
"""Query rows a tile, tried on each side (forward and decode may differ: rlrun runs 64 and 16)."""


def train_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, block_m: int) -> torch.Tensor:
    """Causal attention of ``[S, T, H, D]`` queries over ``[S, T, H_kv, D]`` keys and values (equal lengths)."""
    samples, length, heads, dim = q.shape
    bounds = torch.arange(0, (samples + 1) * length, length, dtype=torch.int32, device=q.device)
    packed = [t.reshape(samples * length, t.shape[2], dim) for t in (q, k, v)]
    out = chunked_attention.causal_varlen(*packed, bounds, length, dim**-0.5, block_m=block_m, chunk=chunk)[0]
    return out.view(samples, length, heads, dim)


def _reference(q, k, v) -> torch.Tensor:
    """fp32 causal attention of one sample ([T, H, D] queries, [T, H_kv, D] keys/values)."""
    groups = q.shape[1] // k.shape[1]
    q32, k32, v32 = (
        t.float().transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
    )
    return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True).transpose(0, 1)


def exactness(
    heads: int, kv_heads: int, length: int, rows: int, chunk: int, forward_m: int, decode_m: int, device, dtype
) -> dict:
    """Decode rows at a sample's last ``rows`` positions against the forward's rows, and both against fp32."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = (torch.randn(length, heads, 128, generator=gen, device=device) * 0.5).to(dtype)
    k = (torch.randn(length, kv_heads, 128, generator=gen, device=device) * 0.5).to(dtype)
    v = torch.randn(length, kv_heads, 128, generator=gen, device=device).to(dtype)
    trained = train_forward(q[None], k[None], v[None], chunk, forward_m)[0]
    positions = torch.arange(length - rows, length, device=device)
    cache_k = k.transpose(0, 1)[None].expand(rows, -1, -1, -1).contiguous()
    cache_v = v.transpose(0, 1)[None].expand(rows, -1, -1, -1).contiguous()
    counts = (positions + 1).to(torch.int32)
    decoded = chunked_attention.decode(
        q[positions].contiguous(), cache_k, cache_v, counts, 128**-0.5, block_m=decode_m, chunk=chunk
    )
    want = trained[positions]
    reference = _reference(q, k, v)
    return {
        "heads": heads, "kv_heads": kv_heads, "length": length, "rows": rows, "chunk": chunk,
        "forward_block_m": forward_m, "decode_block_m": decode_m,
        "elements_differing": int((decoded != want).sum()), "elements": want.numel(),
        "trainer_max_abs_vs_fp32": float((trained.float() - reference).abs().max()),
        "decode_max_abs_vs_fp32": float((decoded.float() - reference[positions]).abs().max()),
    }  # fmt: skip


def decode_speed(batch: int, length: int, chunk: int, block_m: int, iters: int, cache_len: int | None = None) -> dict:
    """The split decode against the engine's path (``attention_kernel.decode``), Qwen3-0.6B's heads (16, 8, 128): every
    row reads ``length`` keys of a cache of ``cache_len`` columns (``length``: a full cache; more: the engine's whole
    cache early in a long generation, where most chunks are empty)."""
    from rlrun.kernels.attention import DecodeRows, decode, positions_per_row

    heads, kv_heads, dim, device = 16, 8, 128, torch.device("cuda")
    columns = cache_len or length
    q = torch.randn(batch, heads, dim, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, columns, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    counts = torch.full((batch,), length, dtype=torch.int32, device=device)
    mask = (torch.arange(columns, device=device) < length).expand(batch, 1, 1, columns)
    rows = DecodeRows.of(mask, heads // kv_heads, positions_per_row(k))
    query = q[:, :, None]

    def split() -> torch.Tensor:
        return chunked_attention.decode(q, k, v, counts, dim**-0.5, block_m=block_m, chunk=chunk)

    return {
        "batch": batch, "length": length, "cache_len": columns, "chunk": chunk, "block_m": block_m,
        "split_us": round(graph_timed_us(split, iters), 2),
        "engine_us": round(graph_timed_us(lambda: decode(query, k, v, rows), iters), 2),
    }  # fmt: skip


def train_speed(samples: int, length: int, chunk: int, block_m: int, iters: int) -> dict:
    """The trainer forward against the memory-efficient varlen forward (the trainer's now), Qwen3-0.6B's heads."""
    from rlrun.kernels import attention as attention_kernel

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
        exactness(h, kv, n, 64 if gpu else 8, c, fm, dm, device, dtype)
        for h, kv, n in shapes
        for c in chunks
        for fm in BLOCK_MS
        for dm in BLOCK_MS
    ]
    if gpu:
        record["decode_speed"] = [
            decode_speed(b, n, c, m, args.iters)
            for b in (64, 128)
            for n in (256, 512, 1024, 2048)
            for c in chunks
            for m in BLOCK_MS
        ] + [decode_speed(64, 384, chunk, 16, args.iters, cache_len=32768) for chunk in chunks]
        record["train_speed"] = [
            train_speed(s, n, c, m, 10) for s, n in ((16, 1024), (1, 8192)) for c in chunks for m in BLOCK_MS
        ]
    emit(record, args.out)


if __name__ == "__main__":
    main()
