"""What the norm kernels that trainer and engine share (:mod:`rlrun.kernels.head_norm`,
:mod:`rlrun.kernels.hidden_norm`) have in
common: the autograd function around a kernel's forward, the Megatron module that runs one, and the in-place
view of head rows that the head-norm kernel reads (here, not beside its caller, so the kernel module imports
no module that imports it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def aligned_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [..., heads, D] as a [rows, heads, D] view that the kernel reads in place: D contiguous, the row and head
    strides multiples of 8 elements and the base 16-byte aligned; else None (the kernel then reads a copy). A
    dimension of size 1 may carry any stride (the engine's decode queries [B, 1, heads, D], views of its fused q/k/v
    output, have one), which ``view`` ignores, and so does this check: otherwise every such query and key would be
    copied first (two launches a layer of a decode step)."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        return None
    try:
        rows = x.view(-1, *x.shape[-2:])
    except RuntimeError:  # the dimensions above the heads do not flatten to one stride
        return None
    return None if rows.stride(0) % 8 or rows.stride(1) % 8 else rows


class KernelRmsNorm(torch.autograd.Function):
    """A shared norm kernel's forward, ``kernel(x, weight, eps)``; the backward is ``F.rms_norm``'s own, its forward
    run again from the saved input (one bandwidth-bound pass): not bitwise any other backward, since only forwards
    must agree between trainer and engine."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernel(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        needs_x, needs_w = ctx.needs_input_grad[1:3]
        with torch.enable_grad():
            x_ = x.detach().requires_grad_(needs_x)
            w_ = weight.detach().requires_grad_(needs_w)
            y = F.rms_norm(x_, (x.shape[-1],), w_, ctx.eps)
        wanted = [t for t, needed in ((x_, needs_x), (w_, needs_w)) if needed]
        grads = iter(torch.autograd.grad(y, wanted, grad))
        return None, next(grads) if needs_x else None, next(grads) if needs_w else None, None


UNSUPPORTED_FLAGS = (
    "layernorm_zero_centered_gamma",
    "persist_layer_norm",
    "sequence_parallel",
    "memory_efficient_layer_norm",
)
"""Megatron config flags that torch's norms (Megatron's ``WrappedTorchNorm``) do not implement."""


class SharedRMSNorm(torch.nn.RMSNorm):
    """A Megatron norm that the engine's counterpart computes alike (built by ``build_module`` with the config, the
    width and epsilon, as Megatron's ``WrappedTorchNorm`` is): ``torch.nn.RMSNorm``'s weight and name, the shared
    function's forward."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(
                f"normalization ({config.normalization}) must be RMSNorm because {type(self).__name__} normalises "
                "RMSNorm models (rlrun.megatron.attention.layer_spec)"
            )
        for flag in UNSUPPORTED_FLAGS:  # Megatron's WrappedTorchNorm, which this replaces, refuses them too
            if getattr(config, flag):
                raise ValueError(
                    f"{flag} must be off because {type(self).__name__} is torch's RMSNorm with a shared forward "
                    "(plain weight, no sequence-parallel gradient reduction); rlrun never sets it"
                )
        super().__init__(hidden_size, eps=eps)

    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """The function both sides run (each subclass's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)  # type: ignore[arg-type]  # set from eps above
