"""RMSNorm of head vectors read in place (CUDA; imported only where Triton is): Qwen3's per-head query and key norms
straight from the fused q/k/v projection's output, without the copy that ``F.rms_norm`` makes of a strided input.

Why: on ``F.rms_norm`` a Qwen3 decode step runs two such copies and two norm launches a layer, a large share of its
small launches (docs/engine.md, "Where a decode step's time goes"). Both sides call this kernel (the embedded engine's
``q_norm`` / ``k_norm``, the trainer's ``q_layernorm`` / ``k_layernorm``: :mod:`rlrun.kernels.head_norm`), so they stay
bitwise with each other as they did on ``F.rms_norm``.

SAME_CODE: a row's sum of squares is a reduction whose order follows the tile's layout, which Triton derives from
the tile's shape, the warps and what it knows of the addresses. So nothing here depends on the caller: the tile is
``BLOCK_ROWS(D)`` rows of D, four warps, the row and head strides and the counts are not specialised
(``do_not_specialize``), the rows are declared 8-element aligned (``tl.multiple_of``; :func:`rms_norm_rows` copies an
input that is not, or whose base is not 16-byte aligned: :func:`rlrun.kernels.shared_norm.aligned_rows`), and
``enable_fp_fusion=False``. A row then runs the same instructions whether it came from a contiguous tensor (the
trainer's queries) or a strided view (the engine's queries and keys, the trainer's keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrun.kernels.shared_norm import aligned_rows
from rlrun.kernels.triton_support import launch_device

TILE = 2048
"""Elements a program normalises: ``TILE // D`` rows of D."""


@triton.jit(do_not_specialize=["rows", "heads", "stride_r", "stride_h"])
def _rms_norm_rows(x, weight, out, rows, heads, stride_r, stride_h, eps,
                   D: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """Row r = (outer r // heads, head r % heads) at ``x + outer * stride_r + head * stride_h``, D contiguous
    elements; ``out`` is [rows, D] contiguous. fp32 statistics, one rounding of ``x * rstd * w``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    keep = r < rows
    start = tl.multiple_of((r // heads) * stride_r + (r % heads) * stride_h, 8)
    d = tl.arange(0, D)
    xs = tl.load(x + start[:, None] + d[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xs * xs, axis=1) / D + eps)
    w = tl.load(weight + d).to(tl.float32)
    y = xs * rstd[:, None] * w[None, :]
    tl.store(out + r[:, None] * D + d[None, :], y.to(out.dtype.element_ty), mask=keep[:, None])


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (D,), weight, eps)`` for ``x`` [..., heads, D] with D contiguous (any strides above it),
    returned contiguous."""
    rows3 = aligned_rows(x)
    if rows3 is None:
        rows3 = x.contiguous().view(-1, *x.shape[-2:])
    dim, heads = rows3.shape[-1], rows3.shape[-2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    count = rows3.shape[0] * heads
    if count == 0:
        return out
    block = TILE // dim
    with launch_device(x):
        _rms_norm_rows[(triton.cdiv(count, block),)](
            rows3, weight, out, count, heads, rows3.stride(0), rows3.stride(1), eps,
            D=dim, BLOCK_R=block, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out
