"""Whether a decode tile may put the keys, not the query heads, in the tensor-core multiply's M dimension and still
round like the trainer's forward tile.

Why: the exact decode uses the forward's 64-row tile (``chunked_attention.BLOCK_M``) because the tile height
picks the tensor-core instruction and a 16-row one rounds differently. But a Qwen3 decode tile holds G = 2 query heads:
62 of its 64 rows are padding, so each 64-key step multiplies, exponentiates and rescales 32 times the work it keeps
(1.7B profile: attention 0.92 of 3.59 ms a step; BENCHMARKS.md "Where a 1.7B decode step goes"). Transposed, a tile
computes ``S^T = K Q^T`` ([64 keys, 16]) and ``O^T = V^T P^T`` ([D, 16]): every M row real, the same products. Each
output element of a multiply depends only on its own row and column, so it rounds alike in either orientation if the
instruction sums a row-column pair's products in the same order whichever operand is A. That is a property of the
hardware, measured here on random bf16 tiles (``elements_differing`` of each product, per head layout):

* ``scores`` (Q K^T), ``values`` (P V): forward orientation at 64 rows against the transposed tile;
* ``row_sum_dot``: a row's sum of its P as a multiply by ones in both orientations (the forward sums with ``tl.sum``
  today, whose order follows the layout, so a transposed decode needs both sides to sum by a multiply);
* ``row_sum_reduce``: ``tl.sum`` in both orientations (expected to differ: why the sum must change);
* ``control_16_rows``: the forward orientation at a 16-row tile against 64, which rounded apart on the H200 on
  2026-12-03 (f955018): a probe that finds no difference here could not find one anywhere.

    PYTHONPATH=$PWD python3 benchmarks/transposed_decode_probe.py \
        --out benchmarks/results/transposed_decode_probe_h200.json

On CPU (``TRITON_INTERPRET=1 ... --device cpu``) it only checks the kernels' indexing against torch (the interpreter
multiplies with numpy), never the hardware's rounding.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

BLOCK_N = 64
"""Keys a tile (the kernels' ``chunked_attention.BLOCK_N``)."""
HEADS_PADDED = 16
"""The transposed tile's N: a cached head's G query heads padded to the smallest width a Triton multiply takes."""
LAYOUTS = ((2, 128), (4, 128), (3, 64))
"""(G, D): Qwen3-0.6B/1.7B, Qwen3-4B and SmolLM2's query heads a cached head and head widths."""
PRODUCTS = ("scores", "values", "row_sum_dot", "row_sum_reduce")


@triton.jit
def _forward_tile(q, k, v, p, scores, values, sum_dot, sum_reduce,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Tile t as the forward computes it: G query rows of BLOCK_M (the rest padding) against BLOCK_N keys."""
    t = tl.program_id(0).to(tl.int64)
    rows, keys, d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, D)
    real = rows < G
    qt = tl.load(q + (t * G + rows[:, None]) * D + d[None, :], mask=real[:, None], other=0.0)
    kt = tl.load(k + (t * BLOCK_N + keys[:, None]) * D + d[None, :])
    vt = tl.load(v + (t * BLOCK_N + keys[:, None]) * D + d[None, :])
    pt = tl.load(p + (t * G + rows[:, None]) * BLOCK_N + keys[None, :], mask=real[:, None], other=0.0)
    s = tl.dot(qt, tl.trans(kt))
    tl.store(scores + (t * G + rows[:, None]) * BLOCK_N + keys[None, :], s, mask=real[:, None])
    o = tl.dot(pt, vt)
    tl.store(values + (t * G + rows[:, None]) * D + d[None, :], o, mask=real[:, None])
    column = tl.arange(0, 16)
    ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(pt.dtype)
    by_dot = tl.dot(pt, ones)  # every column the row's sum; column 0 kept
    tl.store(sum_dot + t * G + rows[:, None] + 0 * column[None, :], by_dot, mask=real[:, None] & (column[None, :] == 0))
    tl.store(sum_reduce + t * G + rows, tl.sum(pt.to(tl.float32), 1), mask=real)


@triton.jit
def _transposed_tile(q, k, v, p, scores, values, sum_dot, sum_reduce,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr):  # fmt: skip
    """Tile t with the keys as M: ``S^T = K Q^T``, ``O^T = V^T P^T``, the row sums as ``ones P^T``."""
    t = tl.program_id(0).to(tl.int64)
    heads, keys, d = tl.arange(0, HEADS), tl.arange(0, BLOCK_N), tl.arange(0, D)
    real = heads < G
    qt = tl.load(q + (t * G + heads[:, None]) * D + d[None, :], mask=real[:, None], other=0.0)
    kt = tl.load(k + (t * BLOCK_N + keys[:, None]) * D + d[None, :])
    vt = tl.load(v + (t * BLOCK_N + keys[:, None]) * D + d[None, :])
    pt = tl.load(p + (t * G + heads[None, :]) * BLOCK_N + keys[:, None], mask=real[None, :], other=0.0)  # [keys, G]
    s = tl.dot(kt, tl.trans(qt))
    tl.store(scores + (t * G + heads[None, :]) * BLOCK_N + keys[:, None], s, mask=real[None, :])
    o = tl.dot(tl.trans(vt), pt)
    tl.store(values + (t * G + heads[None, :]) * D + d[:, None], o, mask=real[None, :])
    row = tl.arange(0, 64)
    ones = tl.full([64, BLOCK_N], 1.0, tl.float32).to(pt.dtype)
    by_dot = tl.dot(ones, pt)  # every row the heads' sums; row 0 kept
    tl.store(sum_dot + t * G + heads[None, :] + 0 * row[:, None], by_dot, mask=real[None, :] & (row[:, None] == 0))
    tl.store(sum_reduce + t * G + heads, tl.sum(pt.to(tl.float32), 0), mask=real)


def _inputs(tiles: int, groups: int, dim: int, device: str) -> tuple[torch.Tensor, ...]:
    """Random tiles, bf16 on CUDA; fp32 on CPU, where the interpreter's multiplies of bf16 are not bf16's (only the
    indexing is checked there)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(groups * 1000 + dim)
    q = (torch.randn(tiles * groups, dim, generator=gen, device=device) * 0.5).to(dtype)
    k = (torch.randn(tiles * BLOCK_N, dim, generator=gen, device=device) * 0.5).to(dtype)
    v = torch.randn(tiles * BLOCK_N, dim, generator=gen, device=device).to(dtype)
    p = torch.rand(tiles * groups, BLOCK_N, generator=gen, device=device).to(dtype)
    return q, k, v, p


def _outputs(tiles: int, groups: int, dim: int, device: str) -> dict[str, torch.Tensor]:
    shapes = {"scores": (tiles * groups, BLOCK_N), "values": (tiles * groups, dim)}
    shapes |= {"row_sum_dot": (tiles * groups,), "row_sum_reduce": (tiles * groups,)}
    return {name: torch.full(shape, float("nan"), device=device) for name, shape in shapes.items()}


def run(orientation: str, inputs: tuple[torch.Tensor, ...], groups: int, dim: int, block_m: int = 64) -> dict:
    """One orientation's products of every tile (fp32)."""
    tiles = inputs[0].shape[0] // groups
    out = _outputs(tiles, groups, dim, str(inputs[0].device))
    args = (*inputs, *out.values())
    settings = {"num_warps": 4, "enable_fp_fusion": False}
    if orientation == "forward":
        _forward_tile[(tiles,)](*args, G=groups, D=dim, BLOCK_M=block_m, BLOCK_N=BLOCK_N, **settings)
    else:
        _transposed_tile[(tiles,)](*args, G=groups, D=dim, BLOCK_N=BLOCK_N, HEADS=HEADS_PADDED, **settings)
    return out


def reference(inputs: tuple[torch.Tensor, ...], groups: int) -> dict[str, torch.Tensor]:
    """The products in fp64 (torch): what both orientations must approximate, and what the CPU run checks indexing
    against."""
    q, k, v, p = (t.double() for t in inputs)
    tiles = q.shape[0] // groups
    qs, ps = q.view(tiles, groups, -1), p.view(tiles, groups, -1)
    ks, vs = k.view(tiles, BLOCK_N, -1), v.view(tiles, BLOCK_N, -1)
    sums = ps.sum(-1).flatten()
    return {
        "scores": (qs @ ks.transpose(1, 2)).flatten(0, 1),
        "values": (ps @ vs).flatten(0, 1),
        "row_sum_dot": sums,
        "row_sum_reduce": sums,
    }


def compare(groups: int, dim: int, tiles: int, device: str) -> dict:
    """Elements differing between the orientations (and between 16- and 64-row forward tiles), per product; each
    product's largest error against fp64."""
    inputs = _inputs(tiles, groups, dim, device)
    forward, transposed = run("forward", inputs, groups, dim), run("transposed", inputs, groups, dim)
    forward_16 = run("forward", inputs, groups, dim, block_m=16)
    want = reference(inputs, groups)
    record: dict = {"groups": groups, "dim": dim, "tiles": tiles}
    for name in PRODUCTS:
        a, b, c = forward[name], transposed[name], forward_16[name]
        assert not (a.isnan().any() or b.isnan().any() or c.isnan().any()), f"{name}: an element was not written"
        record[name] = {
            "elements": a.numel(),
            "elements_differing": int((a != b).sum()),
            "control_16_rows_differing": int((a != c).sum()),
            "max_error_vs_fp64": float((a.double() - want[name]).abs().max()),
        }
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record: dict = {"benchmark": "transposed_decode_probe", "command": "python3 " + " ".join(sys.argv)}
    record["torch"], record["triton"] = torch.__version__, triton.__version__
    record["hardware"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton interpreter)"
    record["layouts"] = [compare(g, d, args.tiles, args.device) for g, d in LAYOUTS]
    kept = ("scores", "values", "row_sum_dot")
    same = [r[name]["elements_differing"] == 0 for r in record["layouts"] for name in kept]
    record["transposed_tile_rounds_like_the_forward"] = all(same)
    text = json.dumps(record, indent=2)
    print(text)
    with open(args.out, "w") as handle:
        handle.write(text + "\n")


if __name__ == "__main__":
    main()
