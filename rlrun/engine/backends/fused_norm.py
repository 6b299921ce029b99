"""RMSNorm of a transformers decoder as one ``F.rms_norm`` call.

transformers' Llama-family ``RMSNorm.forward`` is eight kernels (two casts, square, mean, add, rsqrt,
two multiplies); Qwen3 runs four norms per layer (input, post-attention, per-head query and key), so a
Qwen3-0.6B decode step launched ~900 small kernels for its norms alone, a fixed cost per step that the
CUDA graph replays but cannot shrink. ``torch.nn.functional.rms_norm`` is one fused kernel on CUDA
(``aten::_fused_rms_norm``), and it is what the Megatron trainer's ``torch.nn.RMSNorm`` computes, so the
engine's log-probs move toward the trainer's, not away (fp32 statistics, one rounding at the end where
transformers rounds before the weight multiply).

Only classes whose ``forward`` is Llama's formula (same source) are replaced: Gemma's ``1 + weight``
norm, for one, is left as it is.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rlrun.engine.backends.same_forward import has_forward_of


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every Llama-formula RMSNorm of ``model`` the fused forward; returns how many."""
    fused = 0
    for module in model.modules():
        if has_forward_of(type(module), LlamaRMSNorm):  # type: ignore[arg-type]  # classes hash; torch types Module.__hash__ oddly
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
    return fused
