"""Megatron's RMSNorms by the shared Triton kernel (rlrun/rmsnorm_kernel.py), the one the embedded engine runs.

rlrun builds Megatron's local layer spec without TransformerEngine or Apex, so every norm of the model (each layer's
input and pre-MLP norms, the per-head query and key norms, the final norm, MLA's latent norms) is what Megatron's
``WrappedTorchNorm`` returns: a plain ``torch.nn.RMSNorm`` with a weight and ``eps=config.layernorm_epsilon``, whose
forward is ``F.rms_norm`` (``aten::_fused_rms_norm``). In the Qwen3-1.7B train step on the H200 its forward and
backward take ~146 ms of a 1.88 s train phase at ~1.4 TB/s; the kernel moves the same bytes once each way.

The hook: ``torch.nn.RMSNorm.forward`` itself, wrapped (idempotent), since ``WrappedTorchNorm`` hands out torch's
class and Megatron's specs name no class of their own to swap. A call takes the kernel when the module is the plain
norm (:func:`plain_rms_norm`: a weight, no bias, ``eps`` set, one normalized dimension; Megatron refuses
zero-centered gamma for torch norms, and torch's class has no ``1 + weight`` form) and the tensors are ones the
kernel covers (``rlrun.engine.backends.fused_norm.kernel_covers``: CUDA with Triton, one dtype, width <= 8192);
every other call runs torch's own forward. The rule is the engine's, read from the engine's module, so both sides
take the kernel on exactly the same calls and their forward bits stay equal (docs/on_policy.md); the kernel's
docstring says why the bits do not depend on how rows are batched (the trainer packs ``[tokens, hidden]`` and
``[tokens, heads, 128]``, the engine decodes ``[batch, hidden]``).

The backward computes in fp32 from the saved input and rstd and rounds once (dx); the weight's gradient is fp32
partial sums, reduced once and returned in the weight's dtype, as torch's is.
"""

from __future__ import annotations

from typing import Any

import torch

from rlrun.engine.backends.fused_norm import kernel_covers


def patch_rms_norm() -> None:
    """Wrap ``torch.nn.RMSNorm.forward`` (idempotent)."""
    if getattr(torch.nn.RMSNorm.forward, "rlrun", False):
        return
    torch_forward = torch.nn.RMSNorm.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not plain_rms_norm(self) or not kernel_covers(x, self.weight):
            return torch_forward(self, x)
        return rms_norm(x, self.weight, self.eps)

    forward.rlrun = True  # type: ignore[attr-defined]
    forward.torch = torch_forward  # type: ignore[attr-defined]  # the reference of the tests
    torch.nn.RMSNorm.forward = forward  # type: ignore[method-assign]


def plain_rms_norm(norm: Any) -> bool:
    """Whether ``norm`` computes ``x * rsqrt(mean(x^2) + eps) * weight`` over its last dimension with a known eps:
    a weight (``elementwise_affine``), no bias, no zero-centered (``1 + weight``) gamma, one normalized dimension."""
    shape = tuple(getattr(norm, "normalized_shape", ()))
    return (
        getattr(norm, "weight", None) is not None
        and getattr(norm, "bias", None) is None
        and not getattr(norm, "zero_centered_gamma", False)
        and getattr(norm, "eps", None) is not None
        and len(shape) == 1
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's norm of ``x [..., N]``, differentiable in ``x`` and ``weight``."""
    return _RMSNorm.apply(x, weight, float(eps))


def _forward_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from rlrun.rmsnorm_kernel import rms_norm_forward

    return rms_norm_forward(x, weight, eps)


def _backward_kernel(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from rlrun.rmsnorm_kernel import rms_norm_backward

    return rms_norm_backward(x, weight, rstd, grad)


class _RMSNorm(torch.autograd.Function):
    """The kernel's forward and backward; saves the input, the weight and the fp32 rstd per row (as torch does)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward_kernel(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _backward_kernel(x, weight, rstd, grad)
        return dx, (dweight if ctx.needs_input_grad[1] else None), None
