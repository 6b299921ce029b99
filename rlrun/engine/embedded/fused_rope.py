"""RoPE of a layer's queries and keys as one Triton kernel on CUDA, bit for bit transformers' formula.

transformers' Llama-family ``apply_rotary_pos_emb`` computes ``x * cos + rotate_half(x) * sin`` for the queries
and again for the keys: ten kernels a layer (four multiplies, two negations, two concatenations, two adds), each a
few microseconds however small its tensor, a large share of a decode step's launches (docs/engine.md, "Where a decode
step's time goes"). The kernel here does
both tensors in one launch and rounds exactly where eager PyTorch rounds: each product to the tensor's dtype, then
their sum (computed in fp32 from the rounded products, no fused multiply-add). So the rotated tensors are the same
bits, the engine's log-probs stay the trainer's (docs/on_policy.md), and only the launch count changes.

The function is swapped in the modeling module of each loaded model whose ``apply_rotary_pos_emb`` and
``rotate_half`` are Llama's (same source, decorators aside): Qwen2/3, Mistral, Llama, Qwen MoE and others; a
family with its own formula (partial rotary, interleaved pairs) keeps it. The swap is process-wide for that
module, which is safe because the result is identical; any call the kernel does not cover (CPU tensors, mixed
dtypes, a strided last dimension, other broadcast layouts, tensors that need a gradient) goes to the original
function. It is also faster for any other model of that family in the process; :func:`unfused` undoes it for a
run that must be stock transformers (``rlrun bench rollout``'s ``generate`` baseline).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.models.llama import modeling_llama

from rlrun.kernels.triton_support import triton_available

RopeFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _source(fn: Any) -> str | None:
    """``fn``'s source without decorator lines (transformers wraps some copies in a kernel-hub decorator)."""
    try:
        lines = inspect.getsource(fn).splitlines()
    except (OSError, TypeError):
        return None
    return "\n".join(line for line in lines if not line.lstrip().startswith("@"))


@functools.cache
def _llama_sources() -> tuple[str | None, str | None]:
    return _source(modeling_llama.apply_rotary_pos_emb), _source(modeling_llama.rotate_half)


def has_llama_rope(module: Any) -> bool:
    """Whether a modeling module's ``apply_rotary_pos_emb`` and ``rotate_half`` are Llama's formula."""
    rope, rotate = getattr(module, "apply_rotary_pos_emb", None), getattr(module, "rotate_half", None)
    if rope is None or rotate is None or _is_fused(module):
        return False
    return (_source(rope), _source(rotate)) == _llama_sources()


def _modules(model: torch.nn.Module) -> list[Any]:
    """The loaded modules that define ``model``'s classes."""
    names = sorted({type(m).__module__ for m in model.modules()})
    return [sys.modules[name] for name in names if name in sys.modules]


def fuse_rotary(model: torch.nn.Module) -> int:
    """Give the modeling modules of ``model``'s classes the fused RoPE (CUDA with Triton only); returns how many
    modules now have it (already fused ones included)."""
    if not triton_available() or next(model.parameters()).device.type != "cuda":
        return 0
    fused = 0
    for module in _modules(model):
        if has_llama_rope(module):
            module.apply_rotary_pos_emb = _fused(module.apply_rotary_pos_emb)
        fused += _is_fused(module)
    return fused


def _is_fused(module: Any) -> bool:
    return getattr(getattr(module, "apply_rotary_pos_emb", None), "_rlrun_original", None) is not None


@contextlib.contextmanager
def unfused(model: torch.nn.Module) -> Iterator[None]:
    """transformers' own RoPE in the modeling modules of ``model``'s classes while inside: for a stock
    transformers run in a process that also holds an engine (``rlrun bench rollout``'s ``generate`` baseline),
    which the process-wide swap would otherwise speed up too."""
    swapped = [(module, module.apply_rotary_pos_emb) for module in _modules(model) if _is_fused(module)]
    for module, fn in swapped:
        module.apply_rotary_pos_emb = fn._rlrun_original
    try:
        yield
    finally:
        for module, fn in swapped:
            module.apply_rotary_pos_emb = fn


def _fused(original: RopeFn) -> RopeFn:
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or not kernel_covers(q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, *args, **kwargs)
        return rope_qk(q, k, cos, sin)

    apply_rotary_pos_emb._rlrun_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def kernel_covers(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """The layout the kernel reads: q, k [B, H, S, D] on CUDA, cos and sin [B, S, D] broadcast over heads
    (``unsqueeze_dim`` 1), one dtype for all four, even D, unit stride along D; and nothing to differentiate
    (the kernel has no backward: the patch is process-wide, and a model trained in this process would
    otherwise lose the gradient through its RoPE without an error)."""
    tensors = (q, k, cos, sin)
    return (
        unsqueeze_dim == 1
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        and q.is_cuda
        and q.dim() == k.dim() == 4
        and cos.dim() == sin.dim() == 3
        and all(t.dtype == q.dtype and t.device == q.device and t.stride(-1) == 1 for t in tensors)
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and q.shape[-1] % 2 == 0
        and k.shape[-1] == cos.shape[-1] == sin.shape[-1] == q.shape[-1]
        and q.shape[0] == k.shape[0]
        and q.shape[2] == k.shape[2]
        and cos.shape == sin.shape == (q.shape[0], q.shape[2], q.shape[-1])
    )


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb(q, k, cos, sin)`` in one launch; outputs laid out like their inputs."""
    from rlrun.kernels import rope as rope_kernel

    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rope_kernel.rope_qk(q, k, cos, sin, q_out, k_out)
    return q_out, k_out
