"""Decode attention on one GPU: which kernel could the embedded engine decode with, exact with the trainer and fast.

Why: at Qwen3-0.6B, batch 64, the engine's decode attention (the memory-efficient kernel under an additive
mask bias, the kernel the trainer runs so that log-probs agree bitwise) is ~1.5 ms of a ~3.8 ms step
(BENCHMARKS.md). A faster decode kernel only helps if the trainer can run the same kernel and every query row's
result stays independent of how many queries share the call. This measures, for one decode step's attention of one
layer (``G = H / H_kv`` query heads per cached head presented as G query rows, as the engine does):

* ``efficient_bias``: today's engine path (``rlrun.kernels.attention.masked``, cache ``[rows, kv_heads, len, dim]``,
  a mask bias over the read columns);
* ``efficient_seqlen``: the same kernel without a bias: packed rows (``cu_seqlens``) and each row's key count as a
  device tensor (``seqlen_k``), cache ``[rows, len, kv_heads, dim]``;
* ``flash_seqused``: FlashAttention-2's varlen kernel the same way (``seqused_k``), G rows per cached head, not
  causal (the rows are one position), which keeps FlashAttention from its split-KV decode path;
* ``flash_gqa``: FlashAttention-2 given the H query heads of one position and grouped K/V (its own decode path,
  split-KV where it chooses): a speed reference, not a candidate (its sums are split differently from the
  trainer's).

and, for each candidate, whether the decode rows are **bitwise** equal to the trainer's forward over the whole
sample (the memory-efficient varlen kernel for the ``efficient_*`` rows, FlashAttention-2's causal varlen for
``flash_seqused``): one sample packed after another (so it does not start at offset 0), decode queries at its last
positions, each row reading the cache up to its own position.

    python3 benchmarks/decode_attention.py --out benchmarks/results/decode_attention_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from rlrun.kernels import attention as attention_kernel

SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-1.7b": (16, 8, 128), "qwen3-4b": (32, 8, 128)}
"""(query heads, key/value heads, head width) of each shape's attention."""


def _rows(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, H, D]`` one-position queries as ``[B * G, H_kv, D]``: query head ``j * G + g`` (transformers'
    ``repeat_kv`` order) becomes row ``b * G + g`` of key/value head ``j``."""
    batch, heads, dim = query.shape
    groups = heads // kv_heads
    return query.view(batch, kv_heads, groups, dim).transpose(1, 2).reshape(batch * groups, kv_heads, dim)


def _unrows(out: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`_rows` on the output."""
    rows, kv_heads, dim = out.shape
    groups = rows // batch
    return out.view(batch, groups, kv_heads, dim).transpose(1, 2).reshape(batch, kv_heads * groups, dim)


class Decode:
    """One decode step's attention inputs for ``batch`` rows whose caches hold ``lengths`` keys (of ``max_len``)."""

    def __init__(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> None:
        # query [B, H, D]; keys/values [B, max_len, H_kv, D] (the varlen layout); lengths [B] int32
        self.query, self.keys, self.values, self.lengths = query, keys, values, lengths
        batch, max_len, kv_heads, dim = keys.shape
        self.batch, self.max_len, self.kv_heads = batch, max_len, kv_heads
        self.groups = query.shape[1] // kv_heads
        self.scale = dim**-0.5
        device = query.device
        self.rows = _rows(query, kv_heads).contiguous()
        self.cu_q = torch.arange(0, batch * self.groups + 1, self.groups, dtype=torch.int32, device=device)
        self.cu_k = torch.arange(0, (batch + 1) * max_len, max_len, dtype=torch.int32, device=device)
        self.cu_one = torch.arange(0, batch + 1, dtype=torch.int32, device=device)
        self.read_len = int(lengths.max())
        # today's layout, [B, H_kv, max_len, D], and its mask over the read columns
        self.flat = [t.view(batch * max_len, kv_heads, t.shape[-1]) for t in (keys, values)]  # the varlen layout
        self.keys_bhsd = keys.transpose(1, 2).contiguous()
        self.values_bhsd = values.transpose(1, 2).contiguous()
        columns = torch.arange(self.read_len, device=device)
        self.mask = (columns[None, :] < lengths[:, None].long()).view(batch, 1, 1, self.read_len)
        self.bias = attention_kernel.mask_bias(self.mask, query.dtype)

    def efficient_bias(self) -> torch.Tensor:
        grouped = self.query.view(self.batch, self.kv_heads, self.groups, -1)
        k = self.keys_bhsd[:, :, : self.read_len]
        v = self.values_bhsd[:, :, : self.read_len]
        out = attention_kernel.masked(grouped, k, v, self.mask, scale=self.scale, bias=self.bias)
        return out.reshape(self.batch, -1, out.shape[-1])

    def efficient_seqlen(self) -> torch.Tensor:
        packed = [t.unsqueeze(0) for t in (self.rows, *self.flat)]
        kwargs = {"scale": self.scale, "seqlen_k": self.lengths}
        out = torch.ops.aten._efficient_attention_forward(
            *packed, None, self.cu_q, self.cu_k, self.groups, self.max_len, 0.0, 0, False, **kwargs
        )[0]
        return _unrows(out.squeeze(0), self.batch)

    def flash_seqused(self) -> torch.Tensor:
        kwargs = {"scale": self.scale, "seqused_k": self.lengths}
        out = torch.ops.aten._flash_attention_forward(
            self.rows, *self.flat, self.cu_q, self.cu_k, self.groups, self.max_len, 0.0, False, False, **kwargs
        )[0]
        return _unrows(out, self.batch)

    def flash_gqa(self) -> torch.Tensor:
        kwargs = {"scale": self.scale, "seqused_k": self.lengths}
        return torch.ops.aten._flash_attention_forward(
            self.query, *self.flat, self.cu_one, self.cu_k, 1, self.max_len, 0.0, True, False, **kwargs
        )[0]


KERNELS = ("efficient_bias", "efficient_seqlen", "flash_seqused", "flash_gqa")
TRAINER = {"efficient_bias": "efficient", "efficient_seqlen": "efficient", "flash_seqused": "flash"}
"""The trainer forward each candidate must equal bitwise; ``flash_gqa`` has none (a speed reference)."""


def graph_timed_us(fn, iters: int) -> float:
    """Microseconds a call: ``fn`` captured in a CUDA graph (as the engine's decode step is, so the host's launch cost
    is not in the figure), replayed ``iters`` times back to back between two CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def speed(shape: str, batch: int, length: int, iters: int, generator: torch.Generator) -> dict:
    """Each kernel's time for one layer's decode attention, every row reading ``length`` keys."""
    heads, kv_heads, dim = SHAPES[shape]
    device, dtype = torch.device("cuda"), torch.bfloat16
    query = torch.randn(batch, heads, dim, generator=generator, device=device).to(dtype)
    keys, values = (
        torch.randn(batch, length, kv_heads, dim, generator=generator, device=device).to(dtype) for _ in range(2)
    )
    lengths = torch.full((batch,), length, dtype=torch.int32, device=device)
    step = Decode(query, keys, values, lengths)
    row = {"shape": shape, "batch": batch, "length": length, "kv_bytes": 2 * keys.numel() * keys.element_size()}
    for name in KERNELS:
        try:
            us = graph_timed_us(getattr(step, name), iters)
            row[name] = {"us": round(us, 2), "tb_per_s": round(row["kv_bytes"] / us / 1e6, 3)}
        except (RuntimeError, TypeError) as error:
            row[name] = {"error": str(error).splitlines()[0][:300]}
    return row


def _trainer(kind: str, query, key, value, bounds, max_len) -> torch.Tensor:
    scale = query.shape[-1] ** -0.5
    if kind == "efficient":
        return attention_kernel.efficient_varlen(query, key, value, bounds, max_len, scale)[0]
    return torch.ops.aten._flash_attention_forward(
        query, key, value, bounds, bounds, max_len, max_len, 0.0, True, False, scale=scale
    )[0]


def exactness(shape: str, before: int, length: int, rows: int, generator: torch.Generator) -> dict:
    """Decode rows at the last ``rows`` positions of a ``length``-token sample (packed after a ``before``-token one
    in the trainer's call) against the trainer's forward: how many output elements differ, and by how much."""
    heads, kv_heads, dim = SHAPES[shape]
    device, dtype = torch.device("cuda"), torch.bfloat16
    total = before + length
    # activations of a real model's scale: unit queries/keys give softmaxes that are nearly one-hot or flat
    query = (torch.randn(total, heads, dim, generator=generator, device=device) * 0.5).to(dtype)
    key = (torch.randn(total, kv_heads, dim, generator=generator, device=device) * 0.5).to(dtype)
    value = torch.randn(total, kv_heads, dim, generator=generator, device=device).to(dtype)
    bounds = torch.tensor([0, before, total], dtype=torch.int32, device=device)
    positions = torch.arange(length - rows, length, device=device)
    sample_k, sample_v = key[before:], value[before:]
    cache_k = sample_k.unsqueeze(0).expand(rows, -1, -1, -1).contiguous()
    cache_v = sample_v.unsqueeze(0).expand(rows, -1, -1, -1).contiguous()
    step = Decode(query[before + positions], cache_k, cache_v, (positions + 1).to(torch.int32))
    result = {"shape": shape, "before": before, "length": length, "rows": rows}
    for name, kind in TRAINER.items():
        try:
            trained = _trainer(kind, query, key, value, bounds, total)[before + positions]
            decoded = getattr(step, name)()
        except (RuntimeError, TypeError) as error:
            result[name] = {"error": str(error).splitlines()[0][:300]}
            continue
        differ = trained != decoded
        result[name] = {
            "trainer": kind,
            "elements_differing": int(differ.sum()),
            "elements": differ.numel(),
            "max_abs_diff": float((trained.float() - decoded.float()).abs().max()),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3-0.6b")
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_attention.py times CUDA kernels: run it on a GPU")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        raise SystemExit(f"--shapes must name shapes from {sorted(SHAPES)}; drop {unknown}")
    generator = torch.Generator(device="cuda").manual_seed(0)
    record = {
        "benchmark": "decode_attention",
        "command": "python3 " + " ".join(sys.argv),
        "torch": torch.__version__,
        "hardware": torch.cuda.get_device_name(),
        "exactness": [
            exactness(shape, before, length, 64, generator)
            for shape in shapes
            for before, length in ((300, 700), (129, 1500))
        ],
        "speed": [
            speed(shape, int(batch), int(length), args.iters, generator)
            for shape in shapes
            for batch in args.batches.split(",")
            for length in args.lengths.split(",")
        ],
    }
    emit(record, args.out)


def emit(record: dict, out: str) -> None:
    """The record printed and written to ``out`` as JSON."""
    text = json.dumps(record, indent=2)
    print(text)
    with open(out, "w") as handle:
        handle.write(text + "\n")


if __name__ == "__main__":
    main()
