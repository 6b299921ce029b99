"""SwiGLU of a fused gate/up tensor as one Triton launch (CUDA; imported only where Triton is), forward bit for bit
eager PyTorch's ``F.silu(gate) * up``.

Why: both sides hold gate and up as the two halves of one GEMM output, ``[..., 2F]`` (Megatron's ``linear_fc1``
per TP rank: [gate shard | up shard]; the engine's fused ``gate_up_proj``, rlrun/engine/embedded/fused_projections.py).
Eagerly, Megatron's unfused gated MLP runs ``silu``, a ``mul``, and in the backward ``silu_backward``, two ``mul``
and the ``cat`` that is the backward of ``torch.chunk``: several passes over memory where one read of the inputs and
one write of the outputs would do (a visible share of a train step's profile, BENCHMARKS.md "Step against peers").
The engine's ``act_fn(gate) * up`` reads the strided column slices of its fused GEMM output, which eager kernels read
unvectorized (docs/engine.md, "Where a decode step's time goes"). Here the forward reads gate and up once and writes
the product; the backward reads gate, up and the output gradient once and writes both input gradients into one
``[..., 2F]`` tensor (no ``cat``).

Exactness (docs/on_policy.md: the trainer and the engine must compute the same bits). PyTorch's CUDA ``silu``
(aten/src/ATen/native/cuda/ActivationSiluKernel.cu) computes, in fp32 for every floating dtype here,
``x / (1 + exp(-x))`` with CUDA's accurate ``expf`` (PyTorch is not built with fast math) and IEEE
round-to-nearest division, then rounds to the tensor's dtype; the ``mul`` that follows computes the product of
the rounded SiLU and ``up`` in fp32 and rounds once. The forward kernel does the same operations in that order:
libdevice's ``__nv_expf`` (Triton's ``tl.exp`` is the approximate ``ex2.approx`` path, which differs in the last
bits), ``tl.div_rn`` (Triton's ``/`` is not correctly rounded for fp32), the rounding of the SiLU to the input
dtype, and the fp32 product rounded once; ``enable_fp_fusion=False`` keeps the compiler from contracting anything
into a fused multiply-add. Assumed, and checked by tests/gpu/test_swiglu_gpu.py (every bf16 and fp16 gate value):
that CUDA's ``expf`` and libdevice's ``__nv_expf`` are the same function (libdevice is CUDA's math library as
bitcode). Triton links libdevice in its flush-to-zero variant (``enable_reflect_ftz``), PyTorch's ``expf`` is not
FTZ; they differ only where an input or the result of ``expf`` is subnormal, and either way ``1 + expf(-x)`` is
then exactly 1 (or 2), so the sum is the same; the division, the add and the product are not FTZ (PTX checked
with Triton 3.9 for sm_90). The compiler turns ``fp32(a) * fp32(b)`` rounded to bf16/fp16 into ``mul.rn.bf16`` /
``mul.rn.f16``: the same result, as the fp32 product of two such values is exact. The negative argument is
formed as ``-x`` in fp32 (exact), as PyTorch does, so ``silu(-inf)`` is NaN (``-inf / inf``) and ``silu(x)``
for ``x < -88.7`` is ``x / inf = -0.0`` on both sides.

The backward need not match eager PyTorch bit for bit (the trainer's gradient is not compared with the engine):
it computes in fp32 from the inputs, ``d silu(g)/dg = s * (1 + g * (1 - s))`` with ``s = sigmoid(g)``, and rounds
each input gradient once (eager rounds ``grad * up`` and the SiLU to the dtype before its other products).

Inputs: the last dimension has unit stride and the rows (all leading dimensions, flattened) any one stride, so a
column slice of a wider tensor is read in place. Tiles of ``BLOCK_R`` rows by ``BLOCK_C`` columns of the F output
columns, masked at both edges (any F, any row count).

LAUNCH_DEVICE: Triton launches on the current CUDA device and its stream, so each launch runs under
:func:`rlrun.kernels.triton_support.launch_device` of its tensors (rlrun.engine.embedded.triton_kernels says why).
"""

from __future__ import annotations

import importlib

import torch
import triton
import triton.language as tl

from rlrun.kernels.triton_support import launch_device

try:  # Triton >= 3.0: the CUDA backend's libdevice bindings (3.6 on the GPU machines, 3.9 where checked)
    libdevice = importlib.import_module("triton.language.extra.cuda.libdevice")
except ImportError:  # the backend-dispatching module of the same functions
    libdevice = importlib.import_module("triton.language.extra.libdevice")

TILE = 2048
"""Elements of a program's tile (16 a thread at 4 warps): 61k programs for a 20,480-token micro-batch at F 6144, and
still ~100 for a 64-row decode step at F 3072 (a Hopper GPU has 132 SMs)."""
MAX_BLOCK_C = 1024


@triton.jit
def _tile(pid_r, pid_c, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _swiglu_fwd(
    x, out, n_rows, F, x_row_stride, out_row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, F, BLOCK_R, BLOCK_C)
    gate_at = x + rows * x_row_stride + cols
    g = tl.load(gate_at, mask=mask, other=0.0)
    u = tl.load(gate_at + F, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    # PyTorch's silu: x / (1 + expf(-x)) in fp32, correctly rounded division, rounded to the dtype.
    silu = tl.div_rn(gf, 1.0 + libdevice.exp(-gf)).to(g.dtype)
    # PyTorch's mul: the fp32 product of the rounded operands, rounded once.
    y = silu.to(tl.float32) * u.to(tl.float32)
    tl.store(out + rows * out_row_stride + cols, y.to(g.dtype), mask=mask)


@triton.jit
def _swiglu_bwd(
    x, dy, dx, n_rows, F, x_row_stride, dy_row_stride, dx_row_stride, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    rows, cols, mask = _tile(tl.program_id(0), tl.program_id(1), n_rows, F, BLOCK_R, BLOCK_C)
    gate_at = x + rows * x_row_stride + cols
    g_in = tl.load(gate_at, mask=mask, other=0.0)
    g = g_in.to(tl.float32)
    u = tl.load(gate_at + F, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(dy + rows * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.div_rn(1.0, 1.0 + libdevice.exp(-g))  # sigmoid(g)
    d_gate = d * u * (s * (1.0 + g * (1.0 - s)))
    d_up = d * (g * s)
    grad_at = dx + rows * dx_row_stride + cols
    tl.store(grad_at, d_gate.to(g_in.dtype), mask=mask)
    tl.store(grad_at + F, d_up.to(g_in.dtype), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, columns]`` with unit column stride: a view where the leading dimensions flatten to one
    stride (a column slice of a wider tensor does), else a copy."""
    flat = t.reshape(-1, t.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _blocks(n_rows: int, n_cols: int) -> tuple[int, int, tuple[int, int]]:
    block_c = min(triton.next_power_of_2(n_cols), MAX_BLOCK_C)
    block_r = min(max(TILE // block_c, 1), triton.next_power_of_2(n_rows))
    return block_r, block_c, (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))


def swiglu_forward(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``x [..., 2F]`` (gate the first F columns, up the last F) as ``[..., F]``."""
    half = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    rows = _rows(x)
    n_rows = rows.shape[0]
    if n_rows == 0 or half == 0:
        return out
    block_r, block_c, grid = _blocks(n_rows, half)
    with launch_device(x):  # LAUNCH_DEVICE
        _swiglu_fwd[grid](
            rows, out, n_rows, half, rows.stride(0), half,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def swiglu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``F.silu(gate) * up`` with respect to ``x [..., 2F]`` under the output gradient
    ``grad [..., F]``, as one ``[..., 2F]`` tensor (the gate's gradient in the first F columns)."""
    half = x.shape[-1] // 2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, grad_rows = _rows(x), _rows(grad)
    n_rows = rows.shape[0]
    if n_rows == 0 or half == 0:
        return dx.zero_()
    block_r, block_c, grid = _blocks(n_rows, half)
    with launch_device(x):  # LAUNCH_DEVICE
        _swiglu_bwd[grid](
            rows, grad_rows, dx, n_rows, half, rows.stride(0), grad_rows.stride(0), 2 * half,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
        )  # fmt: skip
    return dx
