"""RMSNorm of hidden-state rows (CUDA; imported only where Triton is): a decoder layer's input and pre-MLP norms, the
same kernel on the trainer's and the embedded engine's side (:mod:`rlrun.kernels.hidden_norm`).

Why: a decode step runs two hidden-size norms a layer on a few rows each, where torch's fused RMSNorm takes longer a
launch than a program-a-row Triton kernel on the same bytes (BENCHMARKS.md, "Embedded engine against SGLang", the
decode step's profile). One kernel on both sides keeps them bitwise, as ``F.rms_norm`` on
both did.

SAME_CODE (as :mod:`rlrun.kernels.head_norm_kernel`): a row's sum of squares follows the tile's layout, which Triton
derives
from the tile's shape, the warps and what it knows of the addresses. So a program normalises one row of ``D``
elements in a tile of ``BLOCK_D`` (the next power of two), at warps that depend on ``D`` alone, rows ``D`` apart from
a 16-byte aligned base (:func:`rms_norm_hidden_rows` copies an input that is not), ``enable_fp_fusion=False``: the
trainer's [tokens, 1, D] and the engine's [B, S, D] rows run the same instructions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrun.kernels.triton_support import launch_device


@triton.jit
def _rms_norm_hidden(x, residual, weight, out, summed, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ADD: tl.constexpr):
    """Row ``program_id`` of ``x`` and ``out`` ([rows, D] contiguous): fp32 statistics, one rounding of
    ``x * rstd * w``. With ``ADD``, ``x`` is first ``x + residual`` rounded to the input's dtype (as eager PyTorch
    adds), stored in ``summed``: the same row then runs the same reduction as without."""
    start = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK_D)
    keep = d < D
    xs = tl.load(x + start + d, mask=keep, other=0.0)
    if ADD:  # in fp32, rounded once to the dtype: eager PyTorch's sum (and the one correctly rounded sum: fp32 has
        # more than twice bf16's and fp16's precision, so rounding twice cannot differ from rounding once)
        r = tl.load(residual + start + d, mask=keep, other=0.0)
        xs = (xs.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)
        tl.store(summed + start + d, xs, mask=keep)
    xs = xs.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xs * xs, axis=0) / D + eps)
    w = tl.load(weight + d, mask=keep, other=0.0).to(tl.float32)
    tl.store(out + start + d, (xs * rstd * w).to(out.dtype.element_ty), mask=keep)


def warps(dim: int) -> int:
    """The warps a row of ``dim`` runs at (a function of the width alone, so both sides pick the same)."""
    return 4 if dim <= 2048 else 8 if dim <= 8192 else 16


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous from a 16-byte aligned base (a fresh copy otherwise): the rows every caller's kernel reads."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> list[torch.Tensor]:
    """The kernel's outputs: ``[out]``, or ``[out, summed]`` with a residual."""
    x, weight = _aligned(x), _aligned(weight)  # the same specialisation on both sides whatever buffers hold them
    residual = None if residual is None else _aligned(residual)
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim
    if rows:
        with launch_device(x):
            _rms_norm_hidden[(rows,)](
                x, residual, weight, out, summed, eps, D=dim, BLOCK_D=triton.next_power_of_2(dim),
                ADD=residual is not None, num_warps=warps(dim), enable_fp_fusion=False,
            )  # fmt: skip
    return [out] if summed is None else [out, summed]


def rms_norm_hidden_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (D,), weight, eps)`` for ``x`` [..., D], returned contiguous."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm_hidden_rows(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm_hidden_rows(residual + x), residual + x)`` in one launch; ``residual`` shaped as ``x``."""
    out, summed = _launch(x, residual, weight, eps)
    return out, summed
