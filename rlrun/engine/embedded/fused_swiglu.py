"""The MLP's ``act_fn(gate) * up`` as one Triton kernel on the fused gate/up GEMM output (CUDA), bit for bit.

transformers' Llama-family MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. In the engine, gate and up
are the two column halves of one GEMM output (rlrun/engine/embedded/fused_projections.py), so SiLU and the multiply
read strided slices, two kernels and an intermediate tensor per layer (docs/engine.md, "Where a decode step's time
goes"). The kernel (rlrun/kernels/swiglu.py, the one the trainer's Megatron MLP
runs: rlrun/megatron/swiglu_apply.py) reads the fused output once and writes the product, with eager PyTorch's
roundings (SiLU in fp32 rounded to the dtype, then the product rounded once): the same bits as the two kernels, so
the log-probs stay the trainer's (docs/on_policy.md).

Only MLPs whose ``forward`` is Llama's formula (same source: Qwen2/3, Mistral, Llama, the MoE families' dense and
shared-expert MLPs, ...) with a SiLU ``act_fn`` and a fused ``gate_up_proj`` get the new forward, per instance as
rlrun/engine/embedded/fused_norm.py does for RMSNorm; GELU MLPs (Gemma) and other formulas keep theirs. Calls the
kernel does not cover (CPU, a dtype it is not exact for, a gradient to take) run the model's own forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP

from rlrun.engine.embedded.fused_projections import FusedProjection, ProjectionPart
from rlrun.engine.embedded.same_forward import has_forward_of
from rlrun.kernels.triton_support import triton_available


def _silu(act: object) -> bool:
    """transformers' ``ACT2FN["silu"]`` / ``["swish"]`` with its own forward (``F.silu``)."""
    return type(act) in (SiLUActivation, torch.nn.SiLU) and "forward" not in vars(act)


def _fused_gate_up(module: torch.nn.Module) -> FusedProjection | None:
    """The module's ``gate_up_proj`` when ``gate_proj`` and ``up_proj`` are its two halves, in that order."""
    fused, gate, up = (getattr(module, n, None) for n in ("gate_up_proj", "gate_proj", "up_proj"))
    if not (isinstance(fused, FusedProjection) and isinstance(gate, ProjectionPart) and isinstance(up, ProjectionPart)):
        return None
    if gate.fused is not fused or up.fused is not fused or (gate.index, up.index) != (0, 1) or len(fused.bounds) != 3:
        return None
    return fused if gate.out_features == up.out_features else None


def kernel_covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """CUDA with Triton, a dtype the kernel is exact for, one dtype and device, nothing to differentiate."""
    return (
        x.is_cuda
        and x.dtype == weight.dtype
        and x.device == weight.device
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and triton_available()
    )


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    from rlrun.kernels.swiglu import swiglu_forward

    return swiglu_forward(gate_up)


def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
    fused: FusedProjection = self.gate_up_proj
    if not kernel_covers(x, fused.weight):
        return type(self).forward(self, x)
    # The GEMM the gate and up parts would take their columns of (FusedProjection.columns), then the kernel.
    return self.down_proj(swiglu(F.linear(x, fused.weight, fused.bias)))


def fusable(module: torch.nn.Module) -> bool:
    """A Llama-formula MLP with a SiLU ``act_fn`` and fused gate/up projections."""
    llama = has_forward_of(type(module), LlamaMLP)  # type: ignore[arg-type]  # classes hash; torch types Module.__hash__ oddly
    return llama and _silu(getattr(module, "act_fn", None)) and _fused_gate_up(module) is not None


def fuse_swiglu(model: torch.nn.Module) -> int:
    """Give every :func:`fusable` MLP of ``model`` the kernel's forward (CUDA with Triton only); returns how many.
    Run after :func:`~rlrun.engine.embedded.fused_projections.fuse_projections`."""
    if not triton_available() or next(model.parameters()).device.type != "cuda":
        return 0
    fused = 0
    for module in model.modules():
        if fusable(module):
            module.forward = types.MethodType(_fused_forward, module)
            fused += 1
    return fused
