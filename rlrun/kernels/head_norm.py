"""The per-head query and key RMSNorm (Qwen3's QK-norm) that the trainer and the embedded engine share.

On CUDA in bf16 with Triton both sides normalise with :func:`rlrun.kernels.head_norm_kernel.rms_norm_rows`, which reads
the
heads where the fused q/k/v projection wrote them (the engine's decode step no longer copies its queries and keys
first: two launches a layer fewer) and rounds each row identically whatever its layout, so the two sides stay bitwise.
Elsewhere (CPU, fp32, head widths the kernel does not take) both run ``F.rms_norm``, as before. Which one runs is
decided from the tensors alone (:func:`kernel_takes`), so a trainer and its engine on the same kind of tensors always
agree.

The trainer's side is :class:`HeadNorm` (Megatron's ``q_layernorm`` / ``k_layernorm``, in place of the
``torch.nn.RMSNorm`` that Megatron's local spec builds), its backward ``F.rms_norm``'s
(:class:`rlrun.kernels.shared_norm.KernelRmsNorm`); the engine's is :func:`rms_norm_heads` as the forward of
transformers'
``q_norm`` / ``k_norm``
(:func:`rlrun.engine.embedded.fused_norm.fuse_rms_norms`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlrun.kernels.shared_norm import KernelRmsNorm, SharedRMSNorm
from rlrun.kernels.triton_support import triton_available


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether the kernel normalises ``x``: bf16 on CUDA, Triton importable, head width a power of two in 16..256."""
    dim = x.shape[-1]
    return x.is_cuda and x.dtype == torch.bfloat16 and 16 <= dim <= 256 and dim & (dim - 1) == 0 and triton_available()


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x``'s last dimension (fp32 statistics, one rounding of ``x * rstd * weight``)."""
    if kernel_takes(x):
        from rlrun.kernels.head_norm_kernel import rms_norm_rows

        return KernelRmsNorm.apply(rms_norm_rows, x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class HeadNorm(SharedRMSNorm):
    """Megatron's ``q_layernorm`` / ``k_layernorm``: :func:`rms_norm_heads`."""

    norm = staticmethod(rms_norm_heads)
