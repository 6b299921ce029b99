"""Times ``rope_qk`` of rlrun/kernels/rope.py (Triton, CUDA) at the trainer's and the embedded engine's shapes; JSON.

* trainer: the queries, then the keys, of a packed micro-batch (``--tokens``), one tensor a call as
  ``rlrun.megatron.rope_apply`` calls it: ``[S, 1, H, D]`` viewed as ``[1, H, S, D]``, an empty key view, cos and
  sin ``[S, D]`` broadcast over the batch (stride 0). The forward; the backward is the same launch under ``-sin``.
* decode: the engine's step, queries ``[B, HQ, 1, D]`` and keys ``[B, HK, 1, D]`` (views of ``[B, 1, H, D]``
  projections) in one launch, per ``--decode-batches``; timed as plain launches and replayed in a CUDA graph, as the
  engine runs it (launch latency dominates there).

Each shape is first checked bit for bit against the eager formula ``x * cos + rotate_half(x) * sin``, so a fast
wrong kernel is refused, not timed. A time is the median of ``--repeats`` CUDA-event timings of ``--iters`` calls
each; GB/s counts each byte the call must move once (read and write of q and k, the read of cos and sin); the eager
formula's time is printed beside it for reference.

    python scripts/gpu/rope_kernel_bench.py --out rope_kernel_bench.json
    # another version of the kernel, on the same device in the same session:
    git show REV:rlrun/kernels/rope.py > /tmp/rope_kernel_rev.py
    python scripts/gpu/rope_kernel_bench.py --kernel /tmp/rope_kernel_rev.py --out rope_kernel_bench_rev.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from kernel_timing import REPO, median_us, report


def load_rope_qk(path: Path | None) -> Callable[..., None]:
    """``rope_qk`` of the package, or of a copy of rlrun/kernels/rope.py at ``path``."""
    if path is None:
        sys.path.insert(0, str(REPO))
        from rlrun.kernels.rope import rope_qk

        return rope_qk
    spec = importlib.util.spec_from_file_location("rope_kernel_under_test", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rope_qk


def eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` of ``x [B, H, S, D]`` under ``cos``, ``sin`` ``[B, S, D]``."""
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)


def trig(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[*positions.shape, dim]`` of Qwen3's frequencies (base 1e6), halves equal."""
    inv_freq = 1e6 ** -(torch.arange(0, dim, 2, device=positions.device).float() / dim)
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def trainer_case(tokens: int, heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """One tensor of a packed micro-batch, laid out as ``rope_apply._rotate_with_kernel`` hands it over."""
    x = (3 * torch.randn(tokens, 1, heads, dim, device="cuda", generator=gen)).to(dtype)
    out = torch.empty_like(x)
    cos, sin = trig(torch.randint(0, 8192, (tokens,), device="cuda", generator=gen), dim, dtype)
    as_bhsd = lambda y: y.permute(1, 2, 0, 3)  # noqa: E731
    cos_bsd, sin_bsd = (t.view(tokens, 1, dim).permute(1, 0, 2).expand(1, tokens, dim) for t in (cos, sin))
    none = as_bhsd(x)[:, :0]
    return {
        "args": (as_bhsd(x), none, cos_bsd, sin_bsd, as_bhsd(out), none),
        "bytes": 2 * x.nbytes + cos.nbytes + sin.nbytes,
        "shape": {"x": list(x.shape), "layout": "[S, B, H, D] viewed as [B, H, S, D], cos/sin batch stride 0"},
    }


def decode_case(batch: int, q_heads: int, k_heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """One decode step's queries and keys, as a decoder layer hands them to ``apply_rotary_pos_emb``."""
    q = (3 * torch.randn(batch, 1, q_heads, dim, device="cuda", generator=gen)).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(batch, 1, k_heads, dim, device="cuda", generator=gen)).to(dtype).transpose(1, 2)
    cos, sin = trig(torch.randint(0, 8192, (batch, 1), device="cuda", generator=gen), dim, dtype)
    return {
        "args": (q, k, cos, sin, torch.empty_like(q), torch.empty_like(k)),
        "bytes": 2 * (q.nbytes + k.nbytes) + cos.nbytes + sin.nbytes,
        "shape": {"q": list(q.shape), "k": list(k.shape), "layout": "[B, S, H, D] viewed as [B, H, S, D]"},
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def measure(name: str, case: dict, rope_qk: Callable[..., None], args: argparse.Namespace, graph: bool) -> dict:
    q, k, cos, sin, q_out, k_out = case["args"]
    q_out.fill_(float("nan"))
    k_out.fill_(float("nan"))
    rope_qk(*case["args"])
    torch.cuda.synchronize()
    if not (same_bits(q_out, eager(q, cos, sin)) and same_bits(k_out, eager(k, cos, sin))):
        raise SystemExit(f"rope_kernel_bench: {name}: the kernel's result is not the eager formula's bits; not timed")
    us = median_us(lambda: rope_qk(*case["args"]), args.iters, args.repeats)
    row = {"case": name, **case["shape"], "dtype": args.dtype, "bytes": case["bytes"], "us_per_call": round(us, 2)}
    row["gb_per_s"] = round(case["bytes"] / us / 1e3, 1)
    if graph:
        graph_us = median_us(lambda: rope_qk(*case["args"]), args.iters, args.repeats, graph=True)
        row["us_per_call_cuda_graph"] = round(graph_us, 2)
        row["gb_per_s_cuda_graph"] = round(case["bytes"] / graph_us / 1e3, 1)
    row["eager_us_per_call"] = round(
        median_us(lambda: (eager(q, cos, sin), eager(k, cos, sin)), args.iters, args.repeats), 2
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20480, help="packed tokens of a trainer micro-batch")
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--k-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20, help="calls a timing")
    parser.add_argument("--repeats", type=int, default=25, help="timings, of which the median is printed")
    parser.add_argument("--kernel", type=Path, help="a copy of rlrun/kernels/rope.py to time instead of the package's")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rope_kernel_bench: needs a CUDA device (the kernel is Triton on CUDA); none is visible")
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("rope_kernel_bench: needs Triton, which is not installed")
    rope_qk = load_rope_qk(args.kernel)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, heads in (("trainer_queries", args.q_heads), ("trainer_keys", args.k_heads)):
        case = trainer_case(args.tokens, heads, args.head_dim, dtype, gen)
        rows.append(measure(name, case, rope_qk, args, graph=False))
    for batch in args.decode_batches:
        case = decode_case(batch, args.q_heads, args.k_heads, args.head_dim, dtype, gen)
        rows.append(measure(f"decode_b{batch}", case, rope_qk, args, graph=True))
    report(rows, args, kernel=str(args.kernel or "rlrun/kernels/rope.py"))


if __name__ == "__main__":
    main()
