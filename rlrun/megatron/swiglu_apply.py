"""Megatron's gated SiLU MLP activation by the shared Triton kernel (rlrun/kernels/swiglu.py); the same forward bits.

rlrun builds Megatron with ``bias_activation_fusion=False`` (rlrun/megatron/hf_config.py), so megatron-core 0.16.1's
``MLP.forward`` chunks the fc1 output ``[T, (B), 2F/tp]`` into gate and up and computes ``silu(gate) * up`` eagerly:
``silu``, ``mul``, and in the backward ``silu_backward``, two ``mul`` and the ``cat`` of the chunk's gradient, each a
pass over memory. The kernel does the forward in one pass and the backward in another that writes the fc1 output's
gradient ``[.., 2F]`` at once, and keeps only the fc1 output
for the backward (eager autograd also keeps the SiLU output, ``F`` more values a token and layer).

The hook: ``MLP.forward`` itself, wrapped. The gated path's ``glu`` is a closure inside ``MLP.forward`` (nothing to
replace), and the other route, ``bias_activation_fusion=True`` with Megatron's ``bias_swiglu_impl`` swapped, would
change a config flag that Megatron's MoE experts and other layers read as well, and send every non-CUDA call
through Megatron's fused (jit) functions instead of the eager code. For an MLP this covers (:func:`plain_swiglu`:
gated SiLU, no clamp, no offset on ``up``, no TransformerEngine activation, no fp8/fp4, no per-token scale; on CUDA
with Triton), ``MLP.forward`` reduces to ``fc1 -> (+ bias) -> glu -> fc2``, and the wrapper runs exactly that with
the kernel for ``glu``; everything else goes to Megatron's own forward: CPU, other activations, MoE experts (their
``SequentialMLP`` passes the routing probabilities as ``per_token_scale``). Shared experts call ``MLP.forward``
without one and take the kernel. Tensor parallelism is unchanged: each rank's fc1 shard is [gate shard | up shard],
split per rank as Megatron splits it.

The forward is eager PyTorch's ``silu(gate) * up`` bit for bit (the kernel's docstring says how), so the trainer's
log-probs stay the engine's (docs/on_policy.md; the engine runs the same kernel,
rlrun/engine/embedded/fused_swiglu.py). The backward computes in fp32 and rounds once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlrun.kernels.triton_support import triton_available


def patch_swiglu() -> None:
    """Wrap megatron-core's ``MLP.forward`` (idempotent)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.utils import nvtx_range_pop, nvtx_range_push

    if getattr(MLP.forward, "rlrun", False):
        return
    megatron_forward = MLP.forward

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not plain_swiglu(self) or not kernel_covers(hidden_states):
            return megatron_forward(self, hidden_states, per_token_scale, **kwargs)
        # Megatron's forward for this configuration, its glu by the kernel.
        nvtx_range_push(suffix="linear_fc1")
        intermediate, bias = self.linear_fc1(hidden_states)
        nvtx_range_pop(suffix="linear_fc1")
        nvtx_range_push(suffix="activation")
        if bias is not None:
            intermediate = intermediate + bias
        intermediate = swiglu(intermediate)
        nvtx_range_pop(suffix="activation")
        nvtx_range_push(suffix="linear_fc2")
        output, output_bias = self.linear_fc2(intermediate)
        nvtx_range_pop(suffix="linear_fc2")
        return output, output_bias

    forward.rlrun = True  # type: ignore[attr-defined]
    forward.megatron = megatron_forward  # type: ignore[attr-defined]  # the reference of the tests
    MLP.forward = forward


def plain_swiglu(mlp: Any) -> bool:
    """Whether Megatron's ``mlp`` computes ``silu(gate) * up`` of its fc1 output with its eager ``glu``: gated SiLU
    (``config.activation_func``, which ``glu`` calls), neither TransformerEngine's activation module nor
    ``bias_activation_fusion``, no clamp, no offset on ``up``, no fp8/fp4."""
    config = mlp.config
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.use_te_activation_func
        and not config.bias_activation_fusion
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
        and not getattr(config, "fp8", None)
        and not getattr(config, "fp4", None)
    )


def kernel_covers(hidden_states: torch.Tensor) -> bool:
    """CUDA with Triton, and a dtype the kernel is exact for (the fc1 output has the input's)."""
    return (
        hidden_states.is_cuda
        and hidden_states.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and triton_available()
    )


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x [..., 2F]`` by the kernel, differentiable (eager where the kernel cannot take it:
    an odd width, a non-unit stride along it)."""
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(x)


def _forward_kernel(x: torch.Tensor) -> torch.Tensor:
    from rlrun.kernels.swiglu import swiglu_forward

    return swiglu_forward(x)


def _backward_kernel(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    from rlrun.kernels.swiglu import swiglu_backward

    return swiglu_backward(x, grad)


class _SwiGLU(torch.autograd.Function):
    """The kernel's forward and backward; saves only the fc1 output."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _forward_kernel(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _backward_kernel(x, grad)
