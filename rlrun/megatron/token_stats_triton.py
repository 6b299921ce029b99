"""The per-chunk passes of ``rlrun.megatron.token_stats`` as Triton kernels (CUDA; imported only where Triton is).

Eager PyTorch spends six passes over a chunk's ``[tokens, V]`` logits in fp32 on what are two reductions and
one elementwise map: the cast-and-shift copy, ``exp``, the sum, a matrix-vector product for ``sum e (z - m)``
in the forward; the shift again, a multiply-add, ``exp``, a multiply, a scatter and a bf16 cast in the backward.
Those passes were most of the LM head's time at Qwen3's 152K vocabulary (`scripts/gpu/head_cost.py`; BENCHMARKS.md,
"The LM head"). Here each pass reads the model-dtype logits once
and keeps everything else in registers:

* :func:`piece_sums`: per token ``S = sum_v exp(z_v - m)``, the target's ``z_t - m`` (where this rank owns it)
  and ``sum_v exp(z_v - m) (z_v - m)``, given ``m`` (the caller's all-reduced max), ``z = logits / T``.
* :func:`piece_grad`: the logit gradient ``exp(log p) (a log p + b)`` plus ``target_add`` at the target column,
  ``log p = logits / T - log_normalizer``, written in the destination's dtype.

The formulas and their order are the eager ones (``token_stats._torch_piece_sums`` / ``_torch_piece_grad``,
which run on the CPU and are the reference in tests/gpu/test_token_stats_gpu.py); only the summation order
inside a row and the rounding of ``exp`` differ, by a few fp32 ulps.

LAUNCH_DEVICE: Triton launches on the current CUDA device and its stream, so each launch runs under
:func:`rlrun.kernels.triton_support.launch_device` of its tensors (rlrun.engine.embedded.triton_kernels says why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrun.kernels.triton_support import launch_device

BLOCK = 4096
"""Vocabulary columns one program reads per iteration."""


@triton.jit
def _sums(
    logits, logits_row_stride, m, target, owned, out, out_plane_stride, n_cols, inv_t, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * logits_row_stride
    shift = tl.load(m + row)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    weighted = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        z = tl.load(base + cols, mask=keep, other=0.0).to(tl.float32) * inv_t - shift
        e = tl.where(keep, tl.exp(z), 0.0)
        total += e
        weighted += e * z
    t = tl.load(target + row)
    z_t = tl.load(base + t).to(tl.float32) * inv_t - shift
    z_t = tl.where(tl.load(owned + row) != 0, z_t, 0.0)
    tl.store(out + row, tl.sum(total, axis=0))
    tl.store(out + out_plane_stride + row, z_t)
    tl.store(out + 2 * out_plane_stride + row, tl.sum(weighted, axis=0))


@triton.jit
def _grad(
    logits, logits_row_stride, out, out_row_stride, log_normalizer, a, b, target, target_add, n_cols, inv_t,
    HAS_A: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * logits_row_stride
    dst = out + row * out_row_stride
    norm = tl.load(log_normalizer + row)
    coef_b = tl.load(b + row)
    if HAS_A:
        coef_a = tl.load(a + row)
    t = tl.load(target + row)
    add = tl.load(target_add + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        log_p = tl.load(src + cols, mask=keep, other=0.0).to(tl.float32) * inv_t - norm
        if HAS_A:
            dz = tl.exp(log_p) * (coef_a * log_p + coef_b)
        else:
            dz = tl.exp(log_p) * coef_b
        dz = tl.where(cols == t, dz + add, dz)
        tl.store(dst + cols, dz.to(dst.dtype.element_ty), mask=keep)


def piece_sums(
    logits: torch.Tensor, m: torch.Tensor, target: torch.Tensor, owned: torch.Tensor, inv_t: float, out: torch.Tensor
) -> None:
    """Write ``S``, ``z_t - m`` (0 where not ``owned``) and ``sum e (z - m)`` of ``logits [n, V]`` into
    ``out [3, n]`` (fp32, any plane stride, unit token stride); ``m [n]`` fp32, ``target [n]`` local ids."""
    rows, cols = logits.shape
    if rows == 0:
        return
    with launch_device(logits):  # LAUNCH_DEVICE
        _sums[(rows,)](
            logits, logits.stride(0), m.contiguous(), target.contiguous(), owned.to(torch.uint8), out, out.stride(0),
            cols, inv_t, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip


def piece_grad(
    logits: torch.Tensor,
    log_normalizer: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor,
    target: torch.Tensor,
    target_add: torch.Tensor,
    inv_t: float,
    out: torch.Tensor,
) -> None:
    """Write ``exp(log p) (a log p + b)`` (``b`` alone without ``a``), plus ``target_add`` at each row's target
    column, into ``out [n, V]`` (unit column stride, any dtype)."""
    rows, cols = logits.shape
    if rows == 0:
        return
    with launch_device(logits):  # LAUNCH_DEVICE
        _grad[(rows,)](
            logits, logits.stride(0), out, out.stride(0), log_normalizer.contiguous(),
            b if a is None else a.contiguous(), b.contiguous(), target.contiguous(), target_add.contiguous(),
            cols, inv_t, HAS_A=a is not None, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
