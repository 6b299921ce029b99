"""The chunked decode's launch settings (warps, pipeline stages): its time, and whether its rows stay bitwise the
trainer's forward under each.

Why: with one tile height on both sides (``chunked_attention.BLOCK_M = 64``, so that decode and forward
use the same tensor-core instruction) the engine's greedy decode runs 95-97% of SGLang's tokens/s (BENCHMARKS.md
"The exact default beside SGLang"). Warps and stages only schedule the same multiplies and loads, so they may speed the
decode without moving it off the forward's rounding; this measures both claims instead of assuming them. The
forward always runs at the module's settings (the trainer's), the decode at each setting tried. The committed JSON
(2026-12-03) measured the decode as one launch (the last program merges), before ``DECODE_STAGES`` was 3.

    PYTHONPATH=$PWD python3 benchmarks/chunked_decode_launch.py --out benchmarks/results/chunked_decode_launch_h200.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
from decode_attention import emit, graph_timed_us  # benchmarks/, the script's folder
from exact_split_decode import train_forward

from rlrun.kernels import chunked_attention

SETTINGS = ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))
"""(warps, stages) of the decode kernel (the module's: ``WARPS``, ``DECODE_STAGES``)."""


def _decode(q, k, v, counts, warps: int, stages: int) -> torch.Tensor:
    kept = chunked_attention.WARPS, chunked_attention.DECODE_STAGES
    chunked_attention.WARPS, chunked_attention.DECODE_STAGES = warps, stages
    try:
        return chunked_attention.decode(q, k, v, counts, q.shape[-1] ** -0.5)
    finally:
        chunked_attention.WARPS, chunked_attention.DECODE_STAGES = kept


def exactness(heads: int, kv_heads: int, length: int, rows: int, warps: int, stages: int) -> dict:
    """A sample's last ``rows`` positions decoded against the forward's rows (bf16, random data)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(length, heads, 128, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    k = (torch.randn(length, kv_heads, 128, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    v = torch.randn(length, kv_heads, 128, generator=gen, device="cuda").to(torch.bfloat16)
    trained = train_forward(q[None], k[None], v[None], chunked_attention.CHUNK, chunked_attention.BLOCK_M)[0]
    positions = torch.arange(length - rows, length, device="cuda")
    cache_k, cache_v = (t.transpose(0, 1)[None].expand(rows, -1, -1, -1).contiguous() for t in (k, v))
    decoded = _decode(q[positions].contiguous(), cache_k, cache_v, (positions + 1).to(torch.int32), warps, stages)
    differing = int((decoded != trained[positions]).sum())
    return {"heads": heads, "kv_heads": kv_heads, "length": length, "warps": warps, "stages": stages,
            "elements_differing": differing, "elements": decoded.numel()}  # fmt: skip


def speed(batch: int, length: int, warps: int, stages: int, iters: int) -> dict:
    """Qwen3-0.6B/1.7B heads (16 query, 8 cached, 128 wide), every row reading ``length`` keys."""
    q = torch.randn(batch, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    counts = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    us = graph_timed_us(lambda: _decode(q, k, v, counts, warps, stages), iters)
    return {"batch": batch, "length": length, "warps": warps, "stages": stages, "us": round(us, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record: dict = {"benchmark": "chunked_decode_launch", "command": "python3 " + " ".join(sys.argv)}
    record["torch"], record["triton"] = torch.__version__, triton.__version__
    record["hardware"] = torch.cuda.get_device_name()
    record["exactness"] = [
        exactness(h, kv, n, 64, w, s) for h, kv, n in ((16, 8, 700), (32, 8, 1500), (9, 3, 600)) for w, s in SETTINGS
    ]
    record["speed"] = [
        speed(b, n, w, s, args.iters) for b in (64, 128) for n in (256, 384, 1024, 2048) for w, s in SETTINGS
    ]
    emit(record, args.out)


if __name__ == "__main__":
    main()
