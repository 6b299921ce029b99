"""The RMSNorm kernel (rlrun/rmsnorm_kernel.py) under Triton's interpreter, on CPU tensors: against an fp64
reference and fp32 autograd, each row's bits independent of the call's row count and layout, and a trainer norm
and an engine norm giving the same bits. tests/gpu/test_rmsnorm_gpu.py runs the compiled kernel.

The interpreter must be on before Triton is first imported (Triton's own jit functions, ``tl.sum`` among them,
are built at import), and must not be on in a process that runs GPU kernels, so this file runs only in a process
started with ``TRITON_INTERPRET=1``: tests/unit/test_rmsnorm.py's ``test_the_kernel_under_the_interpreter`` starts
one where Triton is installed (CPU machines usually have none: ``pip install --target DIR triton==3.6.0`` and put
DIR on PYTHONPATH).

    TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/unit/test_rmsnorm_interpreted.py
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from test_rmsnorm import fp32_autograd, same_bits

from rlrun.engine.backends import fused_norm
from rlrun.megatron import rmsnorm_apply

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from the process's start (test_rmsnorm.py sets it)", allow_module_level=True)
pytest.importorskip("triton")


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", torch.nn.RMSNorm.forward)
    rmsnorm_apply.patch_rms_norm()


@pytest.fixture(scope="module")
def kernel():
    import triton

    from rlrun import rmsnorm_kernel

    assert triton.knobs.runtime.interpret and type(rmsnorm_kernel._rms_norm_fwd).__name__ == "InterpretedFunction"
    return rmsnorm_kernel


def fp64_norm(x, w, eps):
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return xd * rstd * w.double(), rstd.reshape(-1)


ROUNDING = {torch.bfloat16: 2**-7, torch.float16: 2**-11, torch.float32: 2**-23}
"""The relative error of one rounding from fp32: half a unit in the last place, but a whole one for bf16 here, as
the interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest; tests/gpu checks half)."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 100), (33, 128), (3, 2048), (2, 3, 4, 64), (1, 16), (5, 1)])
def test_forward_is_the_norm(kernel, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    y, rstd = kernel.rms_norm_forward(x, w, 1e-6)
    want, want_rstd = fp64_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous() and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd.double(), want_rstd, rtol=1e-6, atol=0)
    torch.testing.assert_close(y.double(), want, rtol=ROUNDING[dtype] + 1e-6, atol=1e-6)  # + fp32's own few ulps


def test_empty_rows(kernel):
    y, rstd = kernel.rms_norm_forward(torch.zeros(0, 64), torch.ones(64), 1e-6)
    assert y.shape == (0, 64) and rstd.shape == (0,)
    dx, dw = kernel.rms_norm_backward(torch.zeros(0, 64), torch.ones(64), rstd, torch.zeros(0, 64))
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64))


def qkv_slices(tokens: int, q_heads: int, kv_heads: int, dim: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[1, tokens, heads, dim]`` as column slices of one fused qkv output (the engine's)."""
    qkv = (3 * torch.randn(1, tokens, (q_heads + 2 * kv_heads) * dim, generator=g)).to(dtype)
    q = qkv[..., : q_heads * dim].view(1, tokens, q_heads, dim)
    k = qkv[..., q_heads * dim : (q_heads + kv_heads) * dim].view(1, tokens, kv_heads, dim)
    return q, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [64, 100, 2048])
def test_a_rows_bits_do_not_depend_on_the_call(kernel, dtype, width):
    """Each row's output is the same bits alone, in a batch of any size at any position, and read through strided
    or misaligned layouts (views and copies)."""
    g = torch.Generator().manual_seed(1)
    rows = 37 if width <= 128 else 9
    x = (3 * torch.randn(rows, width, generator=g)).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    full = kernel.rms_norm_forward(x, w, 1e-5)[0]
    for i in (0, 1, rows // 2, rows - 1):
        assert same_bits(kernel.rms_norm_forward(x[i : i + 1], w, 1e-5)[0], full[i : i + 1])
    assert same_bits(kernel.rms_norm_forward(x[3:], w, 1e-5)[0], full[3:])  # every row at another tile position
    wide = torch.cat([x, x], dim=1)[:, :width]  # strided rows, read in place
    assert same_bits(kernel.rms_norm_forward(wide, w, 1e-5)[0], full)
    shifted = torch.cat([torch.zeros(1, dtype=dtype), x.reshape(-1)])[1:].view(rows, width)  # misaligned: copied
    assert same_bits(kernel.rms_norm_forward(shifted, w, 1e-5)[0], full)
    assert same_bits(kernel.rms_norm_forward(x.view(1, rows, 1, width), w, 1e-5)[0].view(rows, width), full)


def test_head_rows_of_a_fused_qkv_are_the_packed_rows(kernel):
    """The engine's per-head rows (column slices of its fused qkv output, [B, S, heads, D]) against the trainer's
    contiguous copies of the same rows, bit for bit."""
    g = torch.Generator().manual_seed(2)
    q, k = qkv_slices(11, 4, 2, 64, torch.bfloat16, g)
    w = torch.randn(64, generator=g).bfloat16()
    for t in (q, k):
        base, inner_n, outer, inner = kernel._rows(t)
        assert base.data_ptr() == t.data_ptr() and (inner_n, outer, inner) == (t.shape[2], t.stride(1), 64)
        got = kernel.rms_norm_forward(t, w, 1e-6)[0]
        assert same_bits(got, kernel.rms_norm_forward(t.contiguous().view(-1, 64), w, 1e-6)[0].view(t.shape))


def test_row_layouts(kernel):
    x = torch.randn(6, 4, 32)
    assert kernel._rows(x)[1:] == (1, 32, 0)
    base, inner_n, outer, inner = kernel._rows(x[:, 1:3])  # [6, 2] rows: 4 * 32 apart, then 32: two strides
    assert (inner_n, outer, inner) == (2, 128, 32) and base.data_ptr() == x[:, 1:3].data_ptr()
    assert kernel._rows(x.transpose(0, 1))[1:] == (6, 32, 128)  # any 3-D tensor takes two strides
    base, inner_n, outer, inner = kernel._rows(torch.randn(3, 4, 5, 32).transpose(0, 1))  # neither: copied
    assert (inner_n, outer, inner) == (1, 32, 0) and base.is_contiguous()
    sliced = torch.randn(6, 4, 3, 32)[:, :, 1]  # [6, 4] rows of stride 96, 96 * 4
    assert kernel._rows(sliced)[1:] == (1, 96, 0) and kernel._rows(sliced)[0].data_ptr() == sliced.data_ptr()
    q = torch.randn(5, 8, 4 * 32)[..., : 3 * 32].view(5, 8, 3, 32)  # two strides: 128 a token, 32 a head
    assert kernel._rows(q)[1:] == (3, 128, 32)
    odd = torch.randn(6, 40)[:, :24]  # width 24 is not a multiple of 16: any stride is read in place
    assert kernel._rows(odd)[1:] == (1, 40, 0)
    unaligned = torch.randn(6, 48)[:, 8:40]  # width 32 at stride 48 (a multiple of 16), base 32 bytes in: aligned
    assert kernel._rows(unaligned)[0].data_ptr() == unaligned.data_ptr()
    assert kernel._rows(torch.randn(6, 40)[:, :32])[1:] == (1, 32, 0)  # stride 40: copied for 16-byte vectors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("shape", "strided_grad"), [((13, 100), False), ((41, 64), True), ((3, 2, 2048), True)])
def test_backward_is_fp32_autograd(kernel, dtype, shape, strided_grad):
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    grad = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype)[..., : shape[-1]]
    grad = grad if strided_grad else grad.contiguous()
    _, rstd = kernel.rms_norm_forward(x, w, 1e-6)
    dx, dw = kernel.rms_norm_backward(x, w, rstd, grad)
    want_dx, want_dw = fp32_autograd(x, w, 1e-6, grad)
    assert dx.dtype == dw.dtype == dtype and dx.shape == x.shape and dw.shape == w.shape
    rtol = {**ROUNDING, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(dx.float(), want_dx, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(dw.float(), want_dw, rtol=rtol, atol=1e-4)


def test_trainer_norm_is_engine_norm_bitwise(kernel, patched, monkeypatch, tiny_model_dirs):
    """The trainer's patched ``torch.nn.RMSNorm`` on packed rows (``[T, hidden]``, ``[T, 1, heads, D]``) and the
    engine's fused Qwen3 norms on ``[B, S, hidden]`` and fused-qkv head slices, both through the interpreted kernel
    (with the CUDA check of the shared rule lifted): the same bits; gradients flow on the trainer's side."""
    from transformers import AutoModelForCausalLM

    covers = fused_norm.kernel_covers

    def covers_on_cpu(x, w):
        return covers(types.SimpleNamespace(**{**_attrs(x), "is_cuda": True}), w)

    monkeypatch.setattr(fused_norm, "triton_available", lambda: True)
    monkeypatch.setattr(rmsnorm_apply, "kernel_covers", covers_on_cpu)
    monkeypatch.setattr(fused_norm, "kernel_covers", covers_on_cpu)
    monkeypatch.setattr(fused_norm, "kernel_forward", lambda x, w, eps: kernel.rms_norm_forward(x, w, eps)[0])
    monkeypatch.setattr(rmsnorm_apply, "_forward_kernel", kernel.rms_norm_forward)
    monkeypatch.setattr(rmsnorm_apply, "_backward_kernel", kernel.rms_norm_backward)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.bfloat16).eval()
    assert fused_norm.fuse_rms_norms(model) == 4 * model.config.num_hidden_layers + 1
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(4)
    cfg = model.config
    q, k = qkv_slices(9, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, g)
    hidden = (3 * torch.randn(1, 9, cfg.hidden_size, generator=g)).bfloat16()
    for engine_norm, x in ((layer.input_layernorm, hidden), (layer.self_attn.q_norm, q), (layer.self_attn.k_norm, k)):
        trainer_norm = torch.nn.RMSNorm(x.shape[-1], eps=engine_norm.variance_epsilon).bfloat16()
        with torch.no_grad():
            engine_norm.weight.copy_(torch.randn(x.shape[-1], generator=g))
            trainer_norm.weight.copy_(engine_norm.weight)
            engine_out = engine_norm(x)
        packed = x.contiguous().view(9, 1, *x.shape[2:]).requires_grad_()  # Megatron's [S, B, ...] rows
        trainer_out = trainer_norm(packed)
        assert same_bits(trainer_out.detach().view(x.shape), engine_out)
        trainer_out.sum().backward()
        assert packed.grad is not None and trainer_norm.weight.grad is not None


def _attrs(t: torch.Tensor) -> dict:
    return {"is_cuda": t.is_cuda, "device": t.device, "dtype": t.dtype, "shape": t.shape, "dim": t.dim}
