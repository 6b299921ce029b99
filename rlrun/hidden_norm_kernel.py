"""RMSNorm of hidden-state rows (CUDA; imported only where Triton is): a decoder layer's input and pre-MLP norms, the
same kernel on the trainer's and the embedded engine's side (:mod:`rlrun.hidden_norm`).

Why (issue 29): torch's fused RMSNorm took 3.6 us a launch on a decode step's [64, 2,048] hidden states, 57 launches
a Qwen3-1.7B step (0.20 of its 3.59 ms: benchmarks/results/decode_profile_qwen3-1.7b_b64_75a0e49_h200.txt), where
the QK-norm kernel of the same bytes takes 1.8 us. One kernel on both sides keeps them bitwise, as ``F.rms_norm`` on
both did.

SAME_CODE (as :mod:`rlrun.head_norm_kernel`): a row's sum of squares follows the tile's layout, which Triton derives
from the tile's shape, the warps and what it knows of the addresses. So a program normalises one row of ``D``
elements in a tile of ``BLOCK_D`` (the next power of two), at warps that depend on ``D`` alone, rows ``D`` apart from
a 16-byte aligned base (:func:`rms_norm_hidden_rows` copies an input that is not), ``enable_fp_fusion=False``: the
trainer's [tokens, 1, D] and the engine's [B, S, D] rows run the same instructions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrun.triton_support import launch_device


@triton.jit
def _rms_norm_hidden(x, weight, out, eps, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row ``program_id`` of ``x`` and ``out`` ([rows, D] contiguous): fp32 statistics, one rounding of
    ``x * rstd * w``."""
    start = tl.program_id(0).to(tl.int64) * D
    d = tl.arange(0, BLOCK_D)
    keep = d < D
    xs = tl.load(x + start + d, mask=keep, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xs * xs, axis=0) / D + eps)
    w = tl.load(weight + d, mask=keep, other=0.0).to(tl.float32)
    tl.store(out + start + d, (xs * rstd * w).to(out.dtype.element_ty), mask=keep)


def warps(dim: int) -> int:
    """The warps a row of ``dim`` runs at (a function of the width alone, so both sides pick the same)."""
    return 4 if dim <= 2048 else 8 if dim <= 8192 else 16


def rms_norm_hidden_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (D,), weight, eps)`` for ``x`` [..., D], returned contiguous."""
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned
    if weight.data_ptr() % 16:  # the same specialisation on both sides whatever buffer holds the weight
        weight = weight.clone()
    dim = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // dim
    if rows == 0:
        return out
    with launch_device(x):
        _rms_norm_hidden[(rows,)](
            x, weight, out, eps, D=dim, BLOCK_D=triton.next_power_of_2(dim), num_warps=warps(dim),
            enable_fp_fusion=False,
        )  # fmt: skip
    return out
