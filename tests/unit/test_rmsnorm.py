"""The RMSNorm kernel (rlrun/rmsnorm_kernel.py) and its two callers on CPU.

Without Triton: the trainer's patched ``torch.nn.RMSNorm`` leaves CPU tensors and the norms it does not cover on
torch's forward, its kernel path (with a pure-torch stand-in for the kernel) is torch's norm to one rounding with
fp32 autograd's gradients, the coverage rule both sides read, and the norms Megatron builds for rlrun are covered.
With Triton installed (any machine): tests/unit/test_rmsnorm_interpreted.py, the kernel itself under Triton's
interpreter, in a process of its own. tests/gpu/test_rmsnorm_gpu.py runs the compiled kernel.

    pip install --target /tmp/tritonlib triton==3.6.0  # a CPU machine without Triton
    PYTHONPATH=/tmp/tritonlib python -m pytest -q tests/unit/test_rmsnorm.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlrun.engine.backends import fused_norm
from rlrun.megatron import rmsnorm_apply

REPO = Path(__file__).resolve().parents[2]
INTERPRETED = Path(__file__).with_name("test_rmsnorm_interpreted.py")
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def torch_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's formula in torch: fp32 statistics, ``(x * rstd) * w`` in fp32 rounded once; rstd ``[rows]``."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((xf * rstd) * w.float()).to(x.dtype), rstd.reshape(-1)


def torch_backward(x, w, rstd, grad):
    """The kernel's backward in torch: fp32 from the saved rstd, each gradient rounded once."""
    xf, r = x.float(), rstd.view(*x.shape[:-1], 1)
    xhat, g = xf * r, grad.float() * w.float()
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * r
    return dx.to(x.dtype), (grad.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(w.dtype)


def fp32_autograd(x, w, eps, grad):
    """The independent reference: torch's norm in fp32, differentiated by autograd."""
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.rms_norm(xf, wf.shape, wf, eps).backward(grad.float())
    return xf.grad, wf.grad


@pytest.fixture
def patched(monkeypatch):
    """``patch_rms_norm`` for one test: torch's forward comes back after it."""
    monkeypatch.setattr(torch.nn.RMSNorm, "forward", torch.nn.RMSNorm.forward)
    rmsnorm_apply.patch_rms_norm()
    rmsnorm_apply.patch_rms_norm()  # idempotent
    assert torch.nn.RMSNorm.forward.torch.__qualname__ == "RMSNorm.forward"


# --- the callers, without Triton ---------------------------------------------------------------------------------


def norm_like(**extra) -> types.SimpleNamespace:
    return types.SimpleNamespace(weight=torch.ones(8), eps=1e-6, normalized_shape=(8,), **extra)


@pytest.mark.parametrize(
    ("make", "plain"),
    [
        (lambda: torch.nn.RMSNorm(128, eps=1e-6), True),
        (lambda: torch.nn.RMSNorm([128], eps=1e-5), True),
        (lambda: torch.nn.RMSNorm(128), False),  # eps None: torch takes the dtype's epsilon at call time
        (lambda: torch.nn.RMSNorm(128, eps=1e-6, elementwise_affine=False), False),  # no weight
        (lambda: torch.nn.RMSNorm((4, 32), eps=1e-6), False),  # two normalized dimensions
        (lambda: norm_like(bias=torch.zeros(8)), False),
        (lambda: norm_like(zero_centered_gamma=True), False),
        (lambda: norm_like(), True),
    ],
)  # fmt: skip
def test_only_the_plain_norm_is_covered(make, plain):
    """torch's RMSNorm has no bias and no ``1 + weight`` form; a norm-like object with either is refused."""
    assert rmsnorm_apply.plain_rms_norm(make()) is plain


def fake(shape, dtype=torch.bfloat16, cuda=True, device="cuda:0"):
    """The attributes ``kernel_covers`` reads, of a CUDA tensor this machine cannot make."""
    return types.SimpleNamespace(
        is_cuda=cuda, device=torch.device(device), dtype=dtype, shape=shape, dim=lambda: len(shape)
    )


@pytest.mark.parametrize(
    ("x", "w", "covered"),
    [
        (fake((20480, 2048)), fake((2048,)), True),
        (fake((20480, 1, 16, 128)), fake((128,)), True),
        (fake((7, 100), torch.float32), fake((100,), torch.float32), True),
        (fake((3, 8192), torch.float16), fake((8192,), torch.float16), True),
        (fake((3, 8200)), fake((8200,)), False),  # wider than a row in registers
        (fake((3, 128)), fake((128,), torch.float32), False),  # mixed dtypes: torch promotes
        (fake((3, 128), torch.float64), fake((128,), torch.float64), False),
        (fake((3, 128)), fake((64,)), False),
        (fake((3, 128)), fake((128,), device="cuda:1"), False),
        (fake((3, 128), cuda=False, device="cpu"), fake((128,), cuda=False, device="cpu"), False),
        (fake((3, 128)), None, False),
    ],
)
def test_kernel_covers(monkeypatch, x, w, covered):
    monkeypatch.setattr(fused_norm, "triton_available", lambda: True)
    assert fused_norm.kernel_covers(x, w) is covered
    monkeypatch.setattr(fused_norm, "triton_available", lambda: False)
    assert not fused_norm.kernel_covers(x, w)


def test_real_cpu_tensors_are_not_covered():
    assert not fused_norm.kernel_covers(torch.zeros(2, 8), torch.ones(8))
    assert rmsnorm_apply.kernel_covers is fused_norm.kernel_covers  # one rule for both sides


def refuse(*args):
    raise AssertionError("the kernel ran on a call it does not cover")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_calls_keep_torchs_forward(patched, monkeypatch, dtype):
    monkeypatch.setattr(rmsnorm_apply, "_forward_kernel", refuse)
    norm = torch.nn.RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (3 * torch.randn(5, 7, 64)).to(dtype).requires_grad_()
    grad = torch.randn(5, 7, 64).to(dtype)
    got = norm(x)
    got.backward(grad)
    got_grads = (x.grad.clone(), norm.weight.grad.clone())
    x.grad = norm.weight.grad = None
    want = F.rms_norm(x, (64,), norm.weight, 1e-6)
    want.backward(grad)
    assert same_bits(got.detach(), want.detach())
    assert same_bits(got_grads[0], x.grad) and same_bits(got_grads[1], norm.weight.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_path_with_a_torch_stand_in(patched, monkeypatch, dtype):
    """Covered calls go through the autograd Function (here with the kernel's formula in torch): torch's norm to one
    rounding, fp32 autograd's gradients for the input and the weight; uncovered modules never reach it."""
    calls = []
    monkeypatch.setattr(rmsnorm_apply, "kernel_covers", lambda x, w: True)
    monkeypatch.setattr(rmsnorm_apply, "_forward_kernel", lambda *a: calls.append("fwd") or torch_forward(*a))
    monkeypatch.setattr(rmsnorm_apply, "_backward_kernel", lambda *a: calls.append("bwd") or torch_backward(*a))
    norm = torch.nn.RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = (3 * torch.randn(9, 2, 64)).to(dtype).requires_grad_()
    grad = torch.randn(9, 2, 64).to(dtype)
    out = norm(x)
    out.backward(grad)
    assert calls == ["fwd", "bwd"]
    assert out.dtype == dtype and out.shape == x.shape
    tol = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(out.float(), F.rms_norm(x.detach().float(), (64,), norm.weight.float(), 1e-5), **tol)
    want_dx, want_dw = fp32_autograd(x, norm.weight, 1e-5, grad)
    assert x.grad.dtype == norm.weight.grad.dtype == dtype
    torch.testing.assert_close(x.grad.float(), want_dx, **tol)
    torch.testing.assert_close(norm.weight.grad.float(), want_dw, rtol=tol["rtol"], atol=1e-4)
    torch.nn.RMSNorm(64, eps=1e-5, elementwise_affine=False).to(dtype)(x)  # not plain: torch's forward
    torch.nn.RMSNorm(64).to(dtype)(x)  # eps None
    assert calls == ["fwd", "bwd"]


def test_engine_fused_forward_on_cpu_is_torchs(monkeypatch):
    monkeypatch.setattr(fused_norm, "kernel_forward", refuse)
    norm = types.SimpleNamespace(weight=torch.randn(64).bfloat16(), variance_epsilon=1e-6)
    x = (3 * torch.randn(4, 3, 64)).bfloat16()
    want = F.rms_norm(x, (64,), norm.weight, 1e-6)
    assert same_bits(fused_norm._fused_forward(norm, x), want)


def test_megatrons_norms_for_rlrun_are_covered(tiny_model_dirs):
    """The local spec's norms (input, pre-MLP, per-head q/k, the final one) are plain ``torch.nn.RMSNorm``s."""
    from megatron.core.transformer.transformer_block import LayerNormImpl

    from rlrun.megatron.attention import layer_spec
    from rlrun.megatron.hf_config import ModelArch, transformer_config

    arch = ModelArch.from_hf_dir(str(tiny_model_dirs["qwen3"]))
    config = transformer_config(arch, 1, 1, "bfloat16")
    spec = layer_spec(arch)
    attention = spec.submodules.self_attention.submodules
    built = [
        (spec.submodules.input_layernorm, arch.hidden_size),
        (spec.submodules.pre_mlp_layernorm, arch.hidden_size),
        (attention.q_layernorm, arch.head_dim),
        (attention.k_layernorm, arch.head_dim),
        (LayerNormImpl, arch.hidden_size),
    ]
    for cls, width in built:
        norm = cls(config=config, hidden_size=width, eps=config.layernorm_epsilon)
        assert type(norm) is torch.nn.RMSNorm and rmsnorm_apply.plain_rms_norm(norm), cls
        assert norm.eps == arch.rms_norm_eps and tuple(norm.normalized_shape) == (width,)


def test_the_kernel_under_the_interpreter():
    """tests/unit/test_rmsnorm_interpreted.py in a process of its own with ``TRITON_INTERPRET=1`` set from the start
    (that file says why)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (its interpreter runs the kernel on CPU tensors)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(INTERPRETED)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
