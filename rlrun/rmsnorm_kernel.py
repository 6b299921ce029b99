"""RMSNorm over the last dimension as one Triton launch forward and one backward (CUDA; imported only where Triton
is), run by both the trainer (rlrun/megatron/rmsnorm_apply.py, Megatron's ``torch.nn.RMSNorm``) and the embedded
engine (rlrun/engine/backends/fused_norm.py, transformers' Llama-formula norms).

    rstd = rsqrt(mean(x * x) + eps)        in fp32, one value a row, kept for the backward
    y    = (x * rstd) * weight             in fp32, rounded once to the input's dtype (as torch's F.rms_norm)

Why: a Qwen3-1.7B GRPO train step on the H200 (4 micro-batches of 20,480 tokens, 28 layers, four norms a layer:
input, pre-MLP, per-head query and key at width 128, plus the final norm) spends 53 ms in torch's
``aten::_fused_rms_norm`` (452 calls, ~1.4 TB/s) and 93 ms in its backward (the input gradient 64 ms, the
weight's column reduction 29 ms) of a 1.88 s train phase. Both are bandwidth-bound: the forward reads x once and
writes y, the backward reads x and dy once, writes dx, and leaves the weight gradient as fp32 partial sums of a few
hundred programs, summed by one small reduction.

Exactness (docs/on_policy.md: the trainer's log-probs and the embedded engine's must be the same bits). This kernel
does not reproduce ``F.rms_norm``'s bits: torch's CUDA kernel (aten/src/ATen/native/cuda/layer_norm_kernel.cu)
reduces with its own thread and block order, which a Triton reduction does not follow. Instead both sides run this
kernel, on CUDA, for exactly the same calls (``rlrun.engine.backends.fused_norm.kernel_covers``, which the trainer's
hook imports), and a row's result depends only on the row: its values, the weight, eps, the width and the dtype,
not on how many rows a call has, where the row sits in it, or the strides it was read through. How:

* CONFIG: the tile (``BLOCK_R`` rows by ``BLOCK_N`` columns) and the warp count are functions of the width alone
  (:func:`_config`), never of the row count, so every call of a width runs one compiled kernel whose layout gives
  every row of a tile the same threads' share and the same reduction tree (masked rows and columns add zeros
  outside it).
* SPECIALIZATION: Triton compiles a variant per integer argument that is 1 or a multiple of 16, and per pointer
  that is 16-byte aligned; the variant's vector width decides how a thread's elements are grouped, hence the
  order of the sum. The row count and strides are ``do_not_specialize``; where the width is a multiple of 16
  (``ALIGNED``, every model rlrun runs) the wrapper hands the kernel only 16-byte aligned bases and strides that
  are multiples of 16 elements (else a copy), and the kernel asserts that with ``tl.multiple_of``, so 16-byte
  loads are kept and every call takes the same variant. ``enable_fp_fusion=False`` keeps the compiler from
  contracting the squares' sum into fused multiply-adds in one variant and not in another.

The backward need not match anything bit for bit (the trainer's gradient is not compared with the engine): fp32
from x, dy, the weight and the saved rstd, ``dx = rstd * (g - xhat * mean(g * xhat))`` with ``xhat = x * rstd``,
``g = dy * weight``, rounded once; the weight's gradient ``sum_rows(dy * xhat)`` in fp32, rounded once to the
weight's dtype.

Rows: all leading dimensions of x, read in place where they flatten to one stride (``[T, H]``, ``[S, B, H]``, the
keys of Megatron's split qkv) or to two (``[B, S, heads, D]`` column slices of the engine's fused qkv GEMM output:
row ``r`` at ``(r // heads) * outer + (r % heads) * inner``); anything else is copied first. The output and the
input gradient are contiguous. Widths up to :data:`MAX_HIDDEN` (a row in registers); the callers fall back beyond.

LAUNCH_DEVICE: Triton launches on the current CUDA device and its stream, so each launch runs under
``torch.cuda.device`` of its tensors (rlrun.engine.backends.triton_kernels says why).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

MAX_HIDDEN = 8192
"""Widest row the kernel holds in registers (16 fp32 values a thread at 16 warps); wider rows fall back to torch."""
TILE = 4096
"""Elements of a forward program's tile: 2 rows at width 2048, 32 rows of a 128-wide head (16 a thread at 8
warps), so a 20,480-token micro-batch is ~10k programs at either width."""
BACKWARD_PROGRAMS_PER_SM = 4
"""Backward programs per SM (each loops over tiles, adding into one fp32 partial of the weight's gradient)."""
ALIGN = 16
"""Elements a stride must be a multiple of, and bytes a base must be aligned to, for the ``ALIGNED`` variant."""


@triton.jit
def _row_offsets(rows, n_inner, outer_stride, inner_stride, ALIGNED: tl.constexpr):
    offsets = (rows // n_inner) * outer_stride + (rows % n_inner) * inner_stride
    if ALIGNED:
        offsets = tl.multiple_of(offsets, 16)  # the wrapper's promise (ALIGN): 16-byte vectors, as in every call
    return offsets


@triton.jit(do_not_specialize=["n_rows", "x_inner_n", "x_outer", "x_inner"])
def _rms_norm_fwd(
    x, w, y, rstd, n_rows, x_inner_n, x_outer, x_inner, eps,
    N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < N)[None, :]
    at = _row_offsets(rows, x_inner_n, x_outer, x_inner, ALIGNED)
    xv = tl.load(x + at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(xv * xv, axis=1) / N + eps)
    wv = tl.load(w + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = (xv * r[:, None]) * wv[None, :]  # torch's order: the normalized value, then the weight; one rounding
    tl.store(y + rows[:, None] * N + cols[None, :], out.to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=row_ok)


@triton.jit(
    do_not_specialize=[
        "n_rows", "x_inner_n", "x_outer", "x_inner", "dy_inner_n", "dy_outer", "dy_inner", "tiles_per_program",
        "n_programs",
    ]
)  # fmt: skip
def _rms_norm_bwd(
    x, w, rstd, dy, dx, dw_partial, n_rows, x_inner_n, x_outer, x_inner, dy_inner_n, dy_outer, dy_inner,
    tiles_per_program, n_programs, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    wv = tl.load(w + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)  # summed over its rows once, after the loop
    # Tiles pid, pid + n_programs, ...; those past the last are all masked. A while loop, as Triton's interpreter
    # (the CPU tests) cannot take a range over a runtime bound with numpy 2.
    i = 0
    while i < tiles_per_program:
        rows = (pid + i * n_programs).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x_at = _row_offsets(rows, x_inner_n, x_outer, x_inner, ALIGNED)
        dy_at = _row_offsets(rows, dy_inner_n, dy_outer, dy_inner, ALIGNED)
        xv = tl.load(x + x_at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dy + dy_at[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=row_ok, other=0.0)
        xhat = xv * r[:, None]
        g = d * wv[None, :]
        c = tl.sum(g * xhat, axis=1) / N
        grad = (g - xhat * c[:, None]) * r[:, None]
        tl.store(dx + rows[:, None] * N + cols[None, :], grad.to(dx.dtype.element_ty), mask=mask)
        dw += d * xhat  # masked rows and columns are zeros
        i += 1
    tl.store(dw_partial + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)


def _config(n: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_N, num_warps)`` for width ``n``: a function of the width alone (CONFIG)."""
    block_n = triton.next_power_of_2(n)
    block_r = max(TILE // block_n, 1)
    return block_r, block_n, min(max(block_r * block_n // 512, 1), 16)


def _aligned(n: int) -> bool:
    return n % ALIGN == 0


def _views(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` with its leading dimensions flattened to one, then to two (the last kept), where a view can."""
    n = t.shape[-1]
    for lead in ((-1,), (-1, t.shape[-2])) if t.dim() >= 2 else ((-1,),):
        try:
            yield t.view(*lead, n)
        except RuntimeError:  # the leading dimensions do not flatten to that many strides
            continue


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``(base, inner_n, outer_stride, inner_stride)``: row ``r`` of ``t``'s flattened leading dimensions starts at
    ``(r // inner_n) * outer_stride + (r % inner_n) * inner_stride`` elements past ``base``. A view where the leading
    dimensions flatten to one or two strides with unit stride along the row, on the terms of SPECIALIZATION; else a
    contiguous copy at a fresh (aligned) address."""
    n = t.shape[-1]
    if (t.stride(-1) == 1 or n == 1) and t.data_ptr() % ALIGN == 0:
        for view in _views(t):
            strides = [0 if size == 1 else stride for size, stride in zip(view.shape, view.stride(), strict=True)][:-1]
            if _aligned(n) and any(s % ALIGN for s in strides):
                break  # a finer view has the same strides
            if len(strides) == 1:
                return view, 1, strides[0], 0
            return view, view.shape[1], strides[0], strides[1]
    return t.clone(memory_format=torch.contiguous_format), 1, n, 0


def _launch_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """LAUNCH_DEVICE on CUDA; nothing to enter on the CPU (Triton's interpreter, the CPU tests)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _weight(weight: torch.Tensor) -> torch.Tensor:
    aligned = weight.is_contiguous() and weight.data_ptr() % ALIGN == 0
    return weight if aligned else weight.clone(memory_format=torch.contiguous_format)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: the norm of ``x [..., N]`` under ``weight [N]`` (same dtype), ``y`` contiguous in x's shape and
    dtype, ``rstd`` fp32 ``[rows]`` for :func:`rms_norm_backward`."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.dtype == x.dtype and 0 < n <= MAX_HIDDEN, (x.shape, weight.shape)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = y.numel() // n
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, rstd
    base, inner_n, outer, inner = _rows(x)
    block_r, block_n, num_warps = _config(n)
    with _launch_device(x):
        _rms_norm_fwd[(triton.cdiv(n_rows, block_r),)](
            base, _weight(weight), y, rstd, n_rows, inner_n, outer, inner, eps,
            N=n, BLOCK_R=block_r, BLOCK_N=block_n, ALIGNED=_aligned(n), num_warps=num_warps, enable_fp_fusion=False,
        )  # fmt: skip
    return y, rstd


def _backward_programs(n_tiles: int, device: torch.device) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(min(n_tiles, sms * BACKWARD_PROGRAMS_PER_SM), 1)


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` of :func:`rms_norm_forward` under the output gradient ``grad`` (x's shape): ``dx``
    contiguous in x's dtype, ``dweight`` in the weight's dtype (fp32 sums, one rounding)."""
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = dx.numel() // n
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    block_r, block_n, num_warps = _config(n)
    n_tiles = triton.cdiv(n_rows, block_r)
    n_programs = _backward_programs(n_tiles, x.device)
    partial = torch.empty(n_programs, n, dtype=torch.float32, device=x.device)
    x_base, x_inner_n, x_outer, x_inner = _rows(x)
    dy_base, dy_inner_n, dy_outer, dy_inner = _rows(grad)
    with _launch_device(x):
        _rms_norm_bwd[(n_programs,)](
            x_base, _weight(weight), rstd, dy_base, dx, partial, n_rows, x_inner_n, x_outer, x_inner,
            dy_inner_n, dy_outer, dy_inner, triton.cdiv(n_tiles, n_programs), n_programs,
            N=n, BLOCK_R=block_r, BLOCK_N=block_n, ALIGNED=_aligned(n), num_warps=num_warps, enable_fp_fusion=False,
        )  # fmt: skip
    return dx, partial.sum(dim=0).to(weight.dtype)
