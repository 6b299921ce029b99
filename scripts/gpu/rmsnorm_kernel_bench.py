"""Times the RMSNorm kernel of rlrun/rmsnorm_kernel.py (Triton, CUDA) against torch's ``F.rms_norm`` at the trainer's
shapes; JSON.

* ``[tokens, hidden]``: a layer's input or pre-MLP norm over a packed micro-batch (Qwen3-1.7B: 20,480 x 2048);
* ``[tokens * heads, head_dim]``: the per-head query norm (16 heads) and key norm (8 heads) at width 128, the
  layout of Megatron's ``[S, 1, heads, 128]``.

Each shape is timed forward alone and forward + backward (input and weight gradients, as autograd runs them in the
train step), for the kernel (``rlrun.megatron.rmsnorm_apply.rms_norm``, the trainer's autograd Function) and for
``F.rms_norm``. Before timing, the kernel's forward is checked against the fp64 norm (one rounding) and its
gradients against fp32 autograd, so a fast wrong kernel is refused, not timed. A time is the median of
``--repeats`` CUDA-event timings of ``--iters`` calls each; GB/s counts each byte a pass must move once (forward:
read x, write y; backward: read x and dy, write dx; the weight and the per-row statistics are left out).

    python scripts/gpu/rmsnorm_kernel_bench.py --out rmsnorm_kernel_bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_timing import REPO, median_us, report


def check(rms_norm: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, eps: float, name: str) -> None:
    """The kernel's forward to one rounding of the fp64 norm, its gradients to bf16 tolerance of fp32 autograd."""
    xk, wk = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = rms_norm(xk, wk, eps)
    grad = torch.randn_like(y)
    y.backward(grad)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.rms_norm(xf, wf.shape, wf, eps).backward(grad.float())
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[x.dtype]
    try:
        torch.testing.assert_close(y.detach().double(), want, rtol=rtol, atol=1e-5)
        torch.testing.assert_close(xk.grad.float(), xf.grad, rtol=rtol, atol=1e-5)
        torch.testing.assert_close(wk.grad.float(), wf.grad, rtol=rtol, atol=1e-2)
    except AssertionError as error:
        raise SystemExit(f"rmsnorm_kernel_bench: {name}: the kernel is off the reference; not timed\n{error}") from None


def measure(name: str, rows: int, width: int, args: argparse.Namespace, rms_norm: Callable[..., torch.Tensor]) -> dict:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(rows, width, device="cuda", generator=gen)).to(dtype)
    w = torch.randn(width, device="cuda", generator=gen).to(dtype)
    dy = torch.randn(rows, width, device="cuda", generator=gen).to(dtype)
    check(rms_norm, x, w, args.eps, name)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch_norm = lambda a, b: F.rms_norm(a, (width,), b, args.eps)  # noqa: E731
    kernel_norm = lambda a, b: rms_norm(a, b, args.eps)  # noqa: E731

    def forward_backward(norm: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(norm(xg, wg), (xg, wg), dy)

    row: dict = {"case": name, "shape": [rows, width], "dtype": args.dtype}
    fwd_bytes, bwd_bytes = 2 * x.nbytes, 3 * x.nbytes
    with torch.no_grad():
        fwd = {"kernel": median_us(lambda: kernel_norm(x, w), args.iters, args.repeats)}
        fwd["torch"] = median_us(lambda: torch_norm(x, w), args.iters, args.repeats)
    both = {k: median_us(forward_backward(n), args.iters, args.repeats) for k, n in
            (("kernel", kernel_norm), ("torch", torch_norm))}  # fmt: skip
    for impl in ("kernel", "torch"):
        row[f"{impl}_forward_us"] = round(fwd[impl], 2)
        row[f"{impl}_forward_gb_per_s"] = round(fwd_bytes / fwd[impl] / 1e3, 1)
        row[f"{impl}_forward_backward_us"] = round(both[impl], 2)
        row[f"{impl}_forward_backward_gb_per_s"] = round((fwd_bytes + bwd_bytes) / both[impl] / 1e3, 1)
    row["forward_speedup"] = round(fwd["torch"] / fwd["kernel"], 2)
    row["forward_backward_speedup"] = round(both["torch"] / both["kernel"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20480, help="packed tokens of a trainer micro-batch")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--k-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20, help="calls a timing")
    parser.add_argument("--repeats", type=int, default=25, help="timings, of which the median is printed")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("rmsnorm_kernel_bench: needs a CUDA device (the kernel is Triton on CUDA); none is visible")
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("rmsnorm_kernel_bench: needs Triton, which is not installed")
    sys.path.insert(0, str(REPO))

    from rlrun.megatron.rmsnorm_apply import rms_norm

    cases = [
        ("hidden", args.tokens, args.hidden),
        ("q_norm", args.tokens * args.q_heads, args.head_dim),
        ("k_norm", args.tokens * args.k_heads, args.head_dim),
    ]
    rows = [measure(name, n_rows, width, args, rms_norm) for name, n_rows, width in cases]
    report(rows, args)


if __name__ == "__main__":
    main()
