"""Causal varlen attention kernels on one GPU: forward and forward+backward speed, and their agreement.

Why: at 32k tokens per sample attention is most of a train step (benchmarks/results/
profile_train_qwen3-4b_32k_full_h200.txt: 80% of CUDA time in sm80 attention kernels), so the trainer's
kernel decides its MFU. This compares, on the packed ``[T, heads, dim]`` layout the trainer attends:

* ``efficient``: the memory-efficient kernel trainer and engine share (rlrun.kernels.attention.causal_varlen), with
  FlashAttention-2's backward behind it on bf16/fp16 (the trainer's path since commit 0f63c17);
* ``efficient_own_bwd``: the memory-efficient kernel forward and backward, grouped key/value heads repeated (the
  trainer's path before that commit);
* ``chunked``: rlrun's chunked Triton forward (``model.packed_attention: chunked_varlen``,
rlrun.kernels.chunked_attention),
  FlashAttention-2's backward fed its log-sum-exp;
* ``flash``: FlashAttention-2's varlen kernel (``aten._flash_attention_forward``);
* ``cudnn_dense``: cuDNN's fused attention through SDPA, one call per sample (``model.packed_attention:
  cudnn_per_sample``);
* ``cudnn``: cuDNN's own varlen entry, ``aten._cudnn_attention_forward`` with ``cu_seqlens`` (on torch 2.11 an
  illegal memory access at 32K tokens and garbage gradients at 16 x 1K: measured, not used).

Each row: TFLOP/s (causal FLOPs: 2 matmuls of ``2 * s^2 / 2 * heads * dim`` per sample forward; backward 2.5x)
and the largest difference of output and gradients from an fp32 reference on the same inputs.

    python3 benchmarks/attention_kernels.py --kernels efficient,flash,cudnn_dense \\
        --out benchmarks/results/attention_kernels_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from rlrun.kernels import attention as attention_kernel

SHAPES = {
    "qwen3-4b_1x32k": (32, 8, 128, [32768]),
    "qwen3-4b_4x8k": (32, 8, 128, [8192] * 4),
    "qwen3-4b_16x1k": (32, 8, 128, [1024] * 16),
    "qwen3-1.7b_1x64k": (16, 8, 128, [65536]),
    "qwen3-1.7b_32x640": (16, 8, 128, [640] * 32),  # a micro-batch of the GRPO step (benchmarks/peer_step.py)
}


def _efficient(q, k, v, bounds, max_len):
    return attention_kernel.causal_varlen(q, k, v, bounds, max_len)


def _efficient_own_bwd(q, k, v, bounds, max_len):
    scale = q.shape[-1] ** -0.5
    return attention_kernel.efficient_varlen(q, k, v, bounds, max_len, scale, logsumexp=torch.is_grad_enabled())[0]


def _chunked(q, k, v, bounds, max_len):
    return attention_kernel.chunked_varlen(q, k, v, bounds, max_len)


def _flash(q, k, v, bounds, max_len):
    return torch.ops.aten._flash_attention_forward(
        q, k, v, bounds, bounds, max_len, max_len, 0.0, True, False, scale=q.shape[-1] ** -0.5
    )[0]


def _cudnn(q, k, v, bounds, max_len):
    k, v = (attention_kernel._repeat_heads(t, q.shape[1], 1) for t in (k, v))
    return torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, bounds, bounds, max_len, max_len, True, 0.0, True, False, scale=q.shape[-1] ** -0.5
    )[0]


def _cudnn_dense(q, k, v, bounds, max_len):
    """cuDNN through SDPA, one ``[1, heads, s, dim]`` call per sample (no ``cu_seqlens``)."""
    outs = []
    for sample in zip(*(t.split((bounds[1:] - bounds[:-1]).tolist()) for t in (q, k, v)), strict=True):
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in sample)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


KERNELS = {
    "efficient": _efficient,
    "efficient_own_bwd": _efficient_own_bwd,
    "chunked": _chunked,
    "flash": _flash,
    "cudnn_dense": _cudnn_dense,
    "cudnn": _cudnn,
}


def _reference(q, k, v, lengths):
    """fp32 per-sample SDPA (math kernel): the independent reference."""
    outs = []
    start = 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].float().transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def measure(name: str, shape, iters: int, kernels: list[str]) -> dict:
    heads, kv_heads, dim, lengths = shape
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(total, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    max_len = max(lengths)
    flops = sum(4 * n * n / 2 * heads * dim for n in lengths)
    check = total <= 16384
    if check:
        ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref_out = _reference(*ref_in, lengths)
        ref_out.backward(grad.float())
    row = {"shape": name, "tokens": total, "heads": heads, "kv_heads": kv_heads, "dim": dim, "kernels": {}}
    for kname in kernels:
        kernel = KERNELS[kname]
        entry = {}
        try:
            inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with torch.no_grad():
                fwd = _timed(lambda kernel=kernel: kernel(q, k, v, bounds, max_len), iters)

            def step(kernel=kernel, inputs=inputs):
                out = kernel(*inputs, bounds, max_len)
                torch.autograd.grad(out, inputs, grad)

            both = _timed(step, iters)
            entry = {
                "fwd_s": fwd,
                "fwd_bwd_s": both,
                "fwd_tflops": flops / fwd / 1e12,
                "fwd_bwd_tflops": 3.5 * flops / both / 1e12,
            }
            if check:
                out = kernel(*inputs, bounds, max_len)
                grads = torch.autograd.grad(out, inputs, grad)
                entry["max_abs_err_out"] = (out.float() - ref_out).abs().max().item()
                entry["max_abs_err_grad"] = [
                    (g.float() - r.grad).abs().max().item() for g, r in zip(grads, ref_in, strict=True)
                ]
                entry["mean_abs_err_out"] = (out.float() - ref_out).abs().mean().item()
        except Exception as error:  # a kernel this torch or GPU lacks is a row, not a crash
            entry = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        row["kernels"][kname] = entry
        torch.cuda.empty_cache()
        print(json.dumps({"shape": name, "kernel": kname, **entry}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py measures CUDA kernels: run it on the GPU machine")
    rows = [measure(name, SHAPES[name], args.iters, args.kernels.split(",")) for name in args.shapes.split(",")]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "command": "python3 " + " ".join(sys.argv),
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
