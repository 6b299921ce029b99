"""RMSNorm of a transformers decoder as one kernel: rlrun's Triton RMSNorm on CUDA (rlrun/rmsnorm_kernel.py), the
one the Megatron trainer's norms run (rlrun/megatron/rmsnorm_apply.py), else one ``F.rms_norm`` call.

transformers' Llama-family ``RMSNorm.forward`` is eight kernels (two casts, square, mean, add, rsqrt,
two multiplies); Qwen3 runs four norms per layer (input, post-attention, per-head query and key), so a
Qwen3-0.6B decode step launched ~900 small kernels for its norms alone, a fixed cost per step that the
CUDA graph replays but cannot shrink. One fused kernel computes the same formula with fp32 statistics and one
rounding at the end (where transformers rounds before the weight multiply), as the trainer does.

Exactness (docs/on_policy.md): the trainer's log-probs and the engine's are the same bits only if both run the
same norm kernel on the same calls. :func:`kernel_covers` is that rule, read by both sides: CUDA with Triton, one
floating dtype for input and weight, a width the kernel holds. The kernel's row result does not depend on the
call's row count or layout (its docstring says how), so the engine's decode rows (``[batch, hidden]``, per-head
``[batch, 1, heads, 128]`` column slices of the fused qkv output, read in place) get the trainer's packed rows' bits.
Elsewhere (CPU, other dtypes) both sides run torch's ``F.rms_norm``.

Only classes whose ``forward`` is Llama's formula (same source) are replaced: Gemma's ``1 + weight``
norm, for one, is left as it is.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from rlrun.engine.backends.same_forward import has_forward_of
from rlrun.triton_support import triton_available

MAX_HIDDEN = 8192
"""Widest row the kernel takes (rlrun.rmsnorm_kernel.MAX_HIDDEN, which imports only where Triton is)."""
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kernel_covers(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether the norm of ``x`` under ``weight`` runs the Triton kernel, on the trainer and in the engine alike:
    CUDA with Triton, input and weight of one dtype the kernel takes and on one device, a 1-D weight as wide as
    the rows, at most :data:`MAX_HIDDEN`."""
    return (
        weight is not None
        and x.is_cuda
        and x.device == weight.device
        and x.dtype == weight.dtype
        and x.dtype in KERNEL_DTYPES
        and weight.dim() == 1
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[0]
        and 0 < weight.shape[0] <= MAX_HIDDEN
        and triton_available()
    )


def kernel_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's norm (no autograd: the engine only infers; the trainer's hook has the differentiable one)."""
    from rlrun.rmsnorm_kernel import rms_norm_forward

    return rms_norm_forward(x, weight, eps)[0]


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    grad = torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad)
    if not grad and kernel_covers(hidden_states, self.weight):
        return kernel_forward(hidden_states, self.weight, self.variance_epsilon)
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every Llama-formula RMSNorm of ``model`` the fused forward; returns how many."""
    # imported here: the trainer reads kernel_covers from this module, and transformers' import loads TorchDynamo,
    # which a trainer process never does (rlrun/runtime/megatron_eager.py)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    fused = 0
    for module in model.modules():
        if has_forward_of(type(module), LlamaRMSNorm):  # type: ignore[arg-type]  # classes hash; torch types Module.__hash__ oddly
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
    return fused
