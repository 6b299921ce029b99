"""The decoder layers' hidden-state RMSNorms (input and pre-MLP) that the trainer and the embedded engine share.

On CUDA in bf16 with Triton both sides normalise with :func:`rlrun.kernels.hidden_norm_kernel.rms_norm_hidden_rows`
(written
because torch's kernel is slow on a decode step's few rows: BENCHMARKS.md, "Rollout engine, earlier runs"; its own
time is not there yet), so they stay bitwise with each
other as they were on ``F.rms_norm``; elsewhere (CPU, fp32) both run ``F.rms_norm``, as before. Which one runs is
decided from the tensor alone (:func:`kernel_takes`). The final norm (``model.norm``, Megatron's ``final_layernorm``)
stays ``F.rms_norm`` on both sides: one launch a step. The engine's decoder layers also add the attention's output
into the residual stream in the same launch (:func:`add_rms_norm_hidden`).

The trainer's side is :class:`HiddenNorm` (Megatron's ``input_layernorm`` / ``pre_mlp_layernorm`` in
:func:`rlrun.megatron.attention.layer_spec`), the engine's :func:`rms_norm_hidden` as the forward of transformers'
``input_layernorm`` / ``post_attention_layernorm`` (:func:`rlrun.engine.embedded.fused_norm.fuse_rms_norms`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlrun.kernels.shared_norm import KernelRmsNorm, SharedRMSNorm
from rlrun.kernels.triton_support import triton_available

MAX_WIDTH = 16384
"""The widest row the kernel takes (one program a row)."""


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether the kernel normalises ``x``: bf16 on CUDA, Triton importable, the width a multiple of 8 up to
    :data:`MAX_WIDTH` (so every row starts 16-byte aligned)."""
    dim = x.shape[-1]
    return x.is_cuda and x.dtype == torch.bfloat16 and dim % 8 == 0 and dim <= MAX_WIDTH and triton_available()


def rms_norm_hidden(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x``'s last dimension (fp32 statistics, one rounding of ``x * rstd * weight``)."""
    if kernel_takes(x):
        from rlrun.kernels.hidden_norm_kernel import rms_norm_hidden_rows

        return KernelRmsNorm.apply(rms_norm_hidden_rows, x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm_hidden(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_hidden(residual + x), residual + x)``: one launch where the kernel takes ``x`` and nothing needs a
    gradient (the engine's decoder layers, ``fused_norm.fuse_residual_norms``), the same bits as the two steps, which
    run otherwise."""
    grad = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad)
    if kernel_takes(x) and residual.shape == x.shape and residual.dtype == x.dtype and not grad:
        from rlrun.kernels.hidden_norm_kernel import add_rms_norm_hidden_rows

        return add_rms_norm_hidden_rows(x, residual, weight, eps)
    summed = residual + x
    return rms_norm_hidden(summed, weight, eps), summed


class HiddenNorm(SharedRMSNorm):
    """Megatron's ``input_layernorm`` / ``pre_mlp_layernorm``: :func:`rms_norm_hidden`."""

    norm = staticmethod(rms_norm_hidden)
