"""On a GPU, the RMSNorm kernel (rlrun/rmsnorm_kernel.py): a row's output bits do not depend on the call (row count,
position, batch layout, strides: one compiled kernel per width and dtype), the forward is the norm to one rounding,
the backward is fp32 autograd's to bf16 tolerance, the trainer's patched ``torch.nn.RMSNorm``
(rlrun/megatron/rmsnorm_apply.py) and the engine's fused norms (rlrun/engine/backends/fused_norm.py) give the same
bits for the same rows, and an engine model with the kernel computes what it computes without it.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_rmsnorm_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
HALF_ULP = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    wrong = got.contiguous().view(BITS[got.dtype]) != want.contiguous().view(BITS[want.dtype])
    if wrong.any():
        at = wrong.nonzero()[:5].tolist()
        pytest.fail(f"{int(wrong.sum())} of {wrong.numel()} values differ, first at {at}: "
                    f"got {got[wrong][:5].tolist()}, want {want[wrong][:5].tolist()}")  # fmt: skip


def norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    from rlrun.rmsnorm_kernel import rms_norm_forward

    return rms_norm_forward(x, w, eps)[0]


def inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (3 * torch.randn(rows, width, device="cuda", generator=g)).to(dtype)
    return x, torch.randn(width, device="cuda", generator=g).to(dtype)


def fp32_autograd(x, w, eps, grad):
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.rms_norm(xf, wf.shape, wf, eps).backward(grad.float())
    return xf.grad, wf.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2048, 128, 1024, 4096, 8192, 100])
def test_a_rows_bits_do_not_depend_on_the_call(dtype, width):
    rows = 4099 if width <= 2048 else 1031
    x, w = inputs(rows, width, dtype)
    full = norm(x, w)
    for i in (0, 1, 2, 31, 32, 33, rows // 2, rows - 1):  # every position of a tile
        assert_same_bits(norm(x[i : i + 1], w), full[i : i + 1])
    for start, stop in ((1, rows), (3, 67), (0, 64), (5, 6 + 128), (rows - 7, rows)):  # decode-sized and shifted
        assert_same_bits(norm(x[start:stop], w), full[start:stop])
    assert_same_bits(norm(x.view(rows, 1, width), w).view(rows, width), full)  # Megatron's [S, B, H]
    assert_same_bits(norm(x[None], w)[0], full)  # the engine's [B, S, H]
    wide = torch.cat([x, x[:, :16]], dim=1)[:, :width]  # rows 16 elements apart from contiguous: read in place
    assert_same_bits(norm(wide, w), full)
    odd = torch.cat([x, x[:, :3]], dim=1)[:, :width]  # a stride not a multiple of 16: copied for width % 16 == 0
    assert_same_bits(norm(odd, w), full)
    shifted = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(rows, width)  # a misaligned base: copied
    assert_same_bits(norm(shifted, w), full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_rows_in_the_engines_and_the_trainers_layouts(dtype):
    """Per-head rows ``[1, tokens, heads, 128]`` as column slices of one fused qkv output (the engine's, two strides),
    Megatron's split keys ``[S, 1, groups, 128]`` (one stride), and contiguous copies: the same bits."""
    tokens, q_heads, kv_heads, dim = 1031, 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = (3 * torch.randn(1, tokens, (q_heads + 2 * kv_heads) * dim, device="cuda", generator=g)).to(dtype)
    w = torch.randn(dim, device="cuda", generator=g).to(dtype)
    q = qkv[..., : q_heads * dim].view(1, tokens, q_heads, dim)
    k = qkv[..., q_heads * dim : (q_heads + kv_heads) * dim].view(1, tokens, kv_heads, dim)
    for t in (q, k):
        want = norm(t.contiguous().view(-1, dim), w).view(t.shape)
        assert_same_bits(norm(t, w), want)
        assert_same_bits(norm(t[:, 5:9], w), want[:, 5:9])  # a decode step's few tokens
    groups = qkv.view(tokens, 1, kv_heads, (q_heads // kv_heads + 2) * dim)  # Megatron's mixed qkv per group
    key = groups[..., (q_heads // kv_heads) * dim : (q_heads // kv_heads + 1) * dim]
    assert_same_bits(norm(key, w), norm(key.contiguous(), w))


def test_one_compiled_kernel_per_width_and_dtype():
    """SPECIALIZATION: row counts (1, multiples of 16, others), strides and layouts all run one compiled forward."""
    from rlrun.rmsnorm_kernel import _rms_norm_fwd

    width = 1536  # a width no other test here uses, so its compilations are this test's alone
    cache = _rms_norm_fwd.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    x, w = inputs(4096, width, torch.bfloat16)
    for t in (x, x[:1], x[:16], x[:17], x[3:], x.view(64, 64, width), torch.cat([x, x[:, :16]], 1)[:, :width]):
        norm(t, w)
    norm(torch.cat([x, x], dim=1)[:, :width].view(2, 2048, width), w)  # strided rows
    norm(x.view(64, 64, width).transpose(0, 1)[:, :, None], w)  # neither one nor two strides: a copy
    assert len(cache) == before + 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(20480, 2048), (20480 * 2, 128), (257, 3, 1000)])
def test_forward_is_the_norm_to_one_rounding(dtype, shape):
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (3 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
    w = torch.randn(shape[-1], device="cuda", generator=g).to(dtype)
    from rlrun.rmsnorm_kernel import rms_norm_forward

    y, rstd = rms_norm_forward(x, w, 1e-6)
    xd = x.double()
    want_rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rstd.double(), want_rstd.reshape(-1), rtol=1e-6, atol=0)
    torch.testing.assert_close(y.double(), xd * want_rstd * w.double(), rtol=HALF_ULP[dtype] + 1e-6, atol=1e-6)
    # torch's kernel rounds the same fp32 formula: at most one unit in the last place apart
    rtol = max(2 * HALF_ULP[dtype], 1e-6)
    torch.testing.assert_close(y.float(), F.rms_norm(x, w.shape, w, 1e-6).float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "strided_grad"),
    [((20480, 2048), False), ((20480 * 2, 128), True), ((300, 2, 1000), True), ((5, 8192), False)],
)
def test_backward_is_fp32_autograd(dtype, shape, strided_grad):
    from rlrun.rmsnorm_kernel import rms_norm_backward, rms_norm_forward

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (3 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
    w = torch.randn(shape[-1], device="cuda", generator=g).to(dtype)
    grad = torch.randn(*shape[:-1], shape[-1] + 16, device="cuda", generator=g).to(dtype)[..., : shape[-1]]
    grad = grad if strided_grad else grad.contiguous()
    _, rstd = rms_norm_forward(x, w, 1e-6)
    dx, dw = rms_norm_backward(x, w, rstd, grad)
    want_dx, want_dw = fp32_autograd(x, w, 1e-6, grad)
    assert dx.dtype == dw.dtype == dtype and dx.shape == x.shape and dw.shape == w.shape
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(dx.float(), want_dx, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(dw.float(), want_dw, rtol=rtol, atol=1e-3 if dtype == torch.float32 else 1e-2)


def test_trainers_patched_norm_takes_the_kernel(monkeypatch):
    """Megatron's norm (``torch.nn.RMSNorm`` from ``WrappedTorchNorm``) through the patch: the kernel's forward bits,
    fp32 autograd's gradients; a norm without a weight stays on torch's forward."""
    from rlrun.megatron import rmsnorm_apply

    monkeypatch.setattr(torch.nn.RMSNorm, "forward", torch.nn.RMSNorm.forward)
    rmsnorm_apply.patch_rms_norm()
    calls = []
    forward_kernel = rmsnorm_apply._forward_kernel
    monkeypatch.setattr(rmsnorm_apply, "_forward_kernel", lambda *a: calls.append(1) or forward_kernel(*a))
    layer = torch.nn.RMSNorm(2048, eps=1e-6).cuda().bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(2048))
    x = (3 * torch.randn(4096, 1, 2048, device="cuda")).bfloat16().requires_grad_()
    grad = torch.randn(4096, 1, 2048, device="cuda").bfloat16()
    out = layer(x)
    out.backward(grad)
    assert calls == [1]
    assert_same_bits(out.detach(), norm(x.detach(), layer.weight.detach()))
    want_dx, want_dw = fp32_autograd(x, layer.weight, 1e-6, grad)
    torch.testing.assert_close(x.grad.float(), want_dx, rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.float(), want_dw, rtol=2**-7, atol=1e-2)
    with torch.no_grad():  # the log-prob passes
        assert_same_bits(layer(x), out.detach())
    assert calls == [1, 1]
    torch.nn.RMSNorm(2048, eps=1e-6, elementwise_affine=False).cuda().bfloat16()(x)  # not plain: torch's forward
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trainer_norm_is_engine_norm_bitwise(monkeypatch, dtype):
    """Qwen3-1.7B's widths: the trainer's norms on packed rows (``[T, 1, 2048]``, contiguous ``[T, 1, heads, 128]``)
    and the engine's fused Qwen3 norms on its rows (``[B, S, 2048]`` at prefill and decode, per-head column slices of
    the fused qkv output): the same bits for the same rows."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from rlrun.engine.backends.fused_norm import fuse_rms_norms
    from rlrun.megatron.rmsnorm_apply import patch_rms_norm

    monkeypatch.setattr(torch.nn.RMSNorm, "forward", torch.nn.RMSNorm.forward)
    patch_rms_norm()
    hidden_size, q_heads, kv_heads, head_dim, tokens, eps = 2048, 16, 8, 128, 300, 1e-6
    engine_norms = torch.nn.ModuleList([Qwen3RMSNorm(hidden_size, eps), Qwen3RMSNorm(head_dim, eps)])
    engine_norms = engine_norms.cuda().to(dtype)
    assert fuse_rms_norms(engine_norms) == 2
    g = torch.Generator(device="cuda").manual_seed(4)
    qkv = (3 * torch.randn(2, tokens, (q_heads + 2 * kv_heads) * head_dim, device="cuda", generator=g)).to(dtype)
    q = qkv[..., : q_heads * head_dim].view(2, tokens, q_heads, head_dim)
    k = qkv[..., q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(2, tokens, kv_heads, head_dim)
    hidden = (3 * torch.randn(2, tokens, hidden_size, device="cuda", generator=g)).to(dtype)
    for engine_norm, x in ((engine_norms[0], hidden), (engine_norms[1], q), (engine_norms[1], k)):
        trainer_norm = torch.nn.RMSNorm(x.shape[-1], eps=eps).cuda().to(dtype)
        with torch.no_grad():
            engine_norm.weight.copy_(torch.randn(x.shape[-1], device="cuda", generator=g))
            trainer_norm.weight.copy_(engine_norm.weight)
            prefill = engine_norm(x)
            decode = engine_norm(x[:, 17:18])  # one token of each of two sequences
        packed = x.reshape(2 * tokens, 1, *x.shape[2:]).detach().requires_grad_()  # Megatron's [S, B, ...] rows
        trainer = trainer_norm(packed)
        assert trainer.grad_fn is not None and type(trainer.grad_fn).__name__.startswith("_RMSNorm")
        assert_same_bits(trainer.detach().view(x.shape), prefill)
        assert_same_bits(decode, prefill[:, 17:18])


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_engine_model_with_the_kernel_is_close_to_without(tmp_path, kind):
    """Not bit for bit (torch's F.rms_norm reduces in another order): the logits to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from rlrun.engine.backends import fused_norm
    from tests.tiny_models import make_tiny_model

    path = make_tiny_model(kind, tmp_path / "m", seed=3)
    ids = torch.randint(0, 100, (3, 41), device="cuda")
    logits = []
    for covers in (lambda x, w: False, fused_norm.kernel_covers):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        fused_norm.fuse_rms_norms(model)
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr(fused_norm, "kernel_covers", covers)
            logits.append(model(ids).logits.float())
    torch.testing.assert_close(logits[1], logits[0], rtol=0.05, atol=0.05)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_kernel_runs_on_its_tensors_device_not_the_current_one():
    from rlrun.rmsnorm_kernel import rms_norm_backward, rms_norm_forward

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    x = (3 * torch.randn(300, 2048, device=dev)).bfloat16()
    w = torch.randn(2048, device=dev).bfloat16()
    grad = torch.randn(300, 2048, device=dev).bfloat16()
    y, rstd = rms_norm_forward(x, w, 1e-6)
    assert_same_bits(y.cpu(), norm(x.cuda(0), w.cuda(0)).cpu())
    dx, dw = rms_norm_backward(x, w, rstd, grad)
    want_dx, want_dw = fp32_autograd(x, w, 1e-6, grad)
    torch.testing.assert_close(dx.float(), want_dx, rtol=2**-7, atol=1e-5)
    assert torch.cuda.current_device() == 0
