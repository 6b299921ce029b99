"""The chunked decode's launch settings (warps, pipeline stages, and ``TRANSPOSED_DECODE``): its time, and whether its
rows stay bitwise the trainer's forward under each.

Why (issue 29): with one tile height on both sides (``chunked_attention.BLOCK_M = 64``, so that decode and forward
use the same tensor-core instruction) the engine's greedy decode runs 95-97% of SGLang's tokens/s (BENCHMARKS.md
"The exact default beside SGLang"). Warps and stages only schedule the same multiplies and loads, so they may speed the
decode without moving it off the forward's rounding; this measures both claims instead of assuming them. The
forward always runs at the module's warps and stages (the trainer's), the decode at each setting tried. The committed
JSON (2026-12-03) measured the decode as one launch (the last program merges), before ``DECODE_STAGES`` was 3.

``TRANSPOSED_DECODE`` (the third field of a setting) changes both sides: the forward's row sums become a multiply
with ones, the decode multiplies with the keys as M (docs/engine.md, "A decode tile with the keys as M"); so its rows
are compared with a forward run under it too, and ``forward`` times the trainer's forward both ways (what the row
sum by a multiply costs the train phase). ``verdict``: whether to turn it on, and at which stages
(benchmarks/decode_verdict.py).

    PYTHONPATH=$PWD python3 benchmarks/chunked_decode_launch.py --out benchmarks/results/chunked_decode_launch_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

import torch
import triton
from decode_attention import emit, graph_timed_us  # benchmarks/, the script's folder
from decode_verdict import verdict
from exact_split_decode import fp32_causal, train_forward, train_speed

from rlrun import chunked_attention

SETTINGS = ((4, 3, False), (4, 2, True), (4, 3, True), (4, 4, True), (8, 3, True))
"""(warps, stages, transposed) of the decode (the module's ``WARPS``, ``DECODE_STAGES``, ``TRANSPOSED_DECODE``)."""


@contextlib.contextmanager
def _settings(warps: int, stages: int, transposed: bool) -> Iterator[None]:
    kept = chunked_attention.WARPS, chunked_attention.DECODE_STAGES, chunked_attention.TRANSPOSED_DECODE
    chunked_attention.WARPS, chunked_attention.DECODE_STAGES, chunked_attention.TRANSPOSED_DECODE = (
        warps, stages, transposed
    )  # fmt: skip
    try:
        yield
    finally:
        chunked_attention.WARPS, chunked_attention.DECODE_STAGES, chunked_attention.TRANSPOSED_DECODE = kept


def exactness(heads: int, kv_heads: int, length: int, rows: int, warps: int, stages: int, transposed: bool) -> dict:
    """A sample's last ``rows`` positions decoded against the forward's rows (bf16, random data); the forward at the
    module's warps and stages, both under ``transposed``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(length, heads, 128, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    k = (torch.randn(length, kv_heads, 128, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    v = torch.randn(length, kv_heads, 128, generator=gen, device="cuda").to(torch.bfloat16)
    with _settings(chunked_attention.WARPS, chunked_attention.STAGES, transposed):
        trained = train_forward(q[None], k[None], v[None], chunked_attention.CHUNK, chunked_attention.BLOCK_M)[0]
    positions = torch.arange(length - rows, length, device="cuda")
    cache_k, cache_v = (t.transpose(0, 1)[None].expand(rows, -1, -1, -1).contiguous() for t in (k, v))
    with _settings(warps, stages, transposed):
        decoded = chunked_attention.decode(
            q[positions].contiguous(), cache_k, cache_v, (positions + 1).to(torch.int32), 128**-0.5
        )
    differing = int((decoded != trained[positions]).sum())
    error = float((trained.float() - fp32_causal(q, k, v)).abs().max())
    return {"heads": heads, "kv_heads": kv_heads, "length": length, "warps": warps, "stages": stages,
            "transposed": transposed, "elements_differing": differing, "elements": decoded.numel(),
            "forward_max_error_vs_fp32": round(error, 5)}  # fmt: skip


def speed(batch: int, length: int, warps: int, stages: int, transposed: bool, iters: int) -> dict:
    """Qwen3-0.6B/1.7B heads (16 query, 8 cached, 128 wide), every row reading ``length`` keys."""
    q = torch.randn(batch, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    counts = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    with _settings(warps, stages, transposed):
        us = graph_timed_us(lambda: chunked_attention.decode(q, k, v, counts, 128**-0.5), iters)
    return {"batch": batch, "length": length, "warps": warps, "stages": stages, "transposed": transposed,
            "us": round(us, 2)}  # fmt: skip


def forward_cost(samples: int, length: int, iters: int) -> dict:
    """The trainer's forward (Qwen3-0.6B heads) with the row sums by ``tl.sum`` and by a multiply."""
    times = {}
    for transposed in (False, True):
        with _settings(chunked_attention.WARPS, chunked_attention.STAGES, transposed):
            times[transposed] = train_speed(samples, length, chunked_attention.CHUNK, chunked_attention.BLOCK_M, iters)
    return {"samples": samples, "length": length, "sum_us": times[False]["split_us"],
            "sum_by_multiply_us": times[True]["split_us"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record: dict = {"benchmark": "chunked_decode_launch", "command": "python3 " + " ".join(sys.argv)}
    record["torch"], record["triton"] = torch.__version__, triton.__version__
    record["hardware"] = torch.cuda.get_device_name()
    record["module"] = {
        "WARPS": chunked_attention.WARPS,
        "DECODE_STAGES": chunked_attention.DECODE_STAGES,
        "TRANSPOSED_DECODE": chunked_attention.TRANSPOSED_DECODE,
    }
    shapes = ((16, 8, 700), (32, 8, 1500), (9, 3, 600))
    record["exactness"] = [exactness(h, kv, n, 64, *setting) for h, kv, n in shapes for setting in SETTINGS]
    record["speed"] = [
        speed(b, n, *setting, args.iters) for b in (64, 128) for n in (256, 384, 1024, 2048) for setting in SETTINGS
    ]
    record["forward"] = [forward_cost(s, n, args.iters // 4 or 1) for s, n in ((4, 8192), (32, 640))]
    record["verdict"] = verdict(record)
    emit(record, args.out)


if __name__ == "__main__":
    main()
