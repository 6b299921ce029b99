"""RMSNorm of a transformers decoder as one ``F.rms_norm`` call, or the kernel the trainer shares.

transformers' Llama-family ``RMSNorm.forward`` is eight kernels (two casts, square, mean, add, rsqrt,
two multiplies); Qwen3 runs four norms per layer (input, post-attention, per-head query and key), so a
Qwen3-0.6B decode step launched ~900 small kernels for its norms alone, a fixed cost per step that the
CUDA graph replays but cannot shrink. ``torch.nn.functional.rms_norm`` is one fused kernel on CUDA
(``aten::_fused_rms_norm``), and it is what the Megatron trainer's ``torch.nn.RMSNorm`` computes, so the
engine's log-probs move toward the trainer's, not away (fp32 statistics, one rounding at the end where
transformers rounds before the weight multiply).

Only classes whose ``forward`` is Llama's formula (same source) are replaced: Gemma's ``1 + weight``
norm, for one, is left as it is. The per-head query and key norms (``q_norm`` / ``k_norm``, Megatron's
``q_layernorm`` / ``k_layernorm``: rlrun.megatron.hf_weights) run :func:`rlrun.kernels.head_norm.rms_norm_heads`, as the
trainer's do: on CUDA in bf16 a kernel that reads the heads in place of the fused q/k/v output; a decoder layer's
input and post-attention norms (Megatron's ``input_layernorm`` / ``pre_mlp_layernorm``) run
:func:`rlrun.kernels.hidden_norm.rms_norm_hidden`, the trainer's too.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from rlrun.engine.embedded.same_forward import has_forward_of
from rlrun.kernels.head_norm import rms_norm_heads
from rlrun.kernels.hidden_norm import add_rms_norm_hidden, rms_norm_hidden

HEAD_NORMS = ("q_norm", "k_norm")
"""transformers' names of the per-head query and key norms (the trainer's ``q_layernorm`` / ``k_layernorm``)."""
HIDDEN_NORMS = ("input_layernorm", "post_attention_layernorm")
"""transformers' names of a decoder layer's hidden norms (the trainer's ``input_layernorm`` / ``pre_mlp_layernorm``)."""


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _head_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_heads(hidden_states, self.weight, self.variance_epsilon)


def _hidden_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm_hidden(hidden_states, self.weight, self.variance_epsilon)


SHARED_FORWARDS = {**dict.fromkeys(HEAD_NORMS, _head_forward), **dict.fromkeys(HIDDEN_NORMS, _hidden_forward)}
"""The norms whose forward the trainer shares, by transformers' name; any other Llama-formula norm (the final
``norm``, an MLA latent's) gets ``F.rms_norm``, as the trainer's counterpart runs."""


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every Llama-formula RMSNorm of ``model`` the fused forward (the head and hidden norms the shared ones);
    returns how many."""
    fused = 0
    for name, module in model.named_modules():
        if has_forward_of(type(module), LlamaRMSNorm):  # type: ignore[arg-type]  # classes hash; torch types Module.__hash__ oddly
            forward = SHARED_FORWARDS.get(name.rsplit(".", 1)[-1], _fused_forward)
            module.forward = types.MethodType(forward, module)
            fused += 1
    return fused


def _add_norm_layer_forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
    """Llama's decoder layer with the attention's residual add and the post-attention norm in one launch."""
    residual = hidden_states
    hidden_states, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
    norm = self.post_attention_layernorm
    hidden_states, residual = add_rms_norm_hidden(hidden_states, residual, norm.weight, norm.variance_epsilon)
    return residual + self.mlp(hidden_states)


def fuse_residual_norms(model: torch.nn.Module) -> int:
    """Give every Llama-formula decoder layer of ``model`` whose post-attention norm runs the shared hidden norm
    (after :func:`fuse_rms_norms`) the forward that adds its attention's output into the residual stream and
    normalises in one launch; returns how many. The trainer adds, then normalises with the same kernel: the same
    bits (rlrun/kernels/hidden_norm_kernel.py)."""
    fused = 0
    for module in model.modules():
        norm = getattr(module, "post_attention_layernorm", None)
        shared = norm is not None and getattr(norm.forward, "__func__", None) is _hidden_forward
        if shared and has_forward_of(type(module), LlamaDecoderLayer):  # type: ignore[arg-type]  # as above
            module.forward = types.MethodType(_add_norm_layer_forward, module)
            fused += 1
    return fused
