"""The bf16-only core attentions (FlashAttention-2's varlen kernel, cuDNN per sample) against the per-sample
memory-efficient path, forward and backward, on packed rows and on unpacked ones, in bf16 on a GPU, with
Qwen3-0.6B's head layout (16 query heads, 8 key/value heads, 128)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

HEADS, KV_HEADS, DIM = 16, 8, 128


def make(cls):
    from core_attention import make_core_attention

    return make_core_attention(cls, HEADS, KV_HEADS, DIM)


def _leaves(shape_of, gen):
    return [
        torch.randn(*shape_of(h), DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    ]


def _run(cls, leaves, grad_out, params):
    inputs = [t.clone().requires_grad_(True) for t in leaves]
    out = make(cls)(*inputs, None, packed_seq_params=params)
    out.backward(grad_out)
    return (out.float(), *(t.grad.float() for t in inputs))


@pytest.mark.parametrize("kernel", ["FlashVarlenCoreAttention", "CudnnCoreAttention", "ChunkedVarlenCoreAttention"])
def test_bf16_kernels_match_per_sample_attention_packed_and_unpacked(kernel):
    from rlrun.megatron import attention
    from rlrun.megatron.attention import SDPACoreAttention, packed_seq_params

    cls = getattr(attention, kernel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [640, 640, 37, 300, 1, 512]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    params = packed_seq_params(positions, torch.device("cuda"))
    assert params.cu_seqlens_device.is_cuda and params.cu_seqlens_q.device.type == "cpu"
    tokens = sum(lengths)
    packed = _leaves(lambda h: (tokens, h), gen)
    packed_grad = torch.randn(tokens, HEADS * DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    unpacked = _leaves(lambda h: (384, 2, h), gen)  # [S, B, heads, dim]: rows of one sample each
    unpacked_grad = torch.randn(384, 2, HEADS * DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    for leaves, grad_out, rows in ((packed, packed_grad, params), (unpacked, unpacked_grad, None)):
        reference = _run(SDPACoreAttention, leaves, grad_out, rows)
        result = _run(cls, leaves, grad_out, rows)
        for got, want, name in zip(result, reference, ("output", "dq", "dk", "dv"), strict=True):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"{kernel} {name} differs")
            # a different kernel: equal to bf16 rounding, not bitwise (so this compares two computations)
        assert not torch.equal(result[0], reference[0]), f"{kernel} ran the reference's kernel"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("qk_dim", "v_dim"), [(128, 128), (192, 128), (20, 10), (12, 12), (16, 8), (24, 20)])
def test_the_shared_kernel_runs_exactly_on_the_head_widths_it_is_said_to_take(dtype, qk_dim, v_dim):
    """rlrun.kernels.attention.kernel_has_head_dims against the kernel itself, in a process of its own (for some
    widths the kernel fails on the device and leaves the CUDA context unusable): where it says no, the kernel
    does not run (so the trainer and the engine fall back to SDPA alike); where it says yes, the kernel runs and
    agrees with SDPA's math, and so does the engine's masked call."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))
    from attention_kernel_widths import in_own_process

    from rlrun.kernels import attention as attention_kernel

    case = in_own_process((dtype, qk_dim, v_dim))
    assert case["kernel"] in ("ok", "error"), case
    assert (case["kernel"] == "ok") is case["kernel_has_head_dims"], case
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    q, k = (torch.randn(2, 4, 9, qk_dim, device="cuda", dtype=torch_dtype) for _ in range(2))
    v = torch.randn(2, 4, 9, v_dim, device="cuda", dtype=torch_dtype)
    assert attention_kernel.uses_shared_kernel(q, v) is case["kernel_has_head_dims"]
    if case["kernel"] == "error":
        return
    tolerance = 2e-2 if dtype == "bf16" else 1e-5
    assert case["max_abs_diff"] <= tolerance, case
    mask = torch.ones(9, 9, dtype=torch.bool, device="cuda").tril()
    reference = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    torch.testing.assert_close(attention_kernel.masked(q, k, v, mask).double(), reference, rtol=0, atol=tolerance)


def _efficient_reference(query, key, value, bounds, max_len, scale):
    """The packed causal attention by torch's own autograd of the memory-efficient kernel, key/value heads repeated
    (what ``attention_kernel.causal_varlen`` ran before its FlashAttention-2 backward)."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return torch.ops.aten._efficient_attention_forward(
        query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), None, bounds, bounds, max_len, max_len, 0.0, 1, True,
        scale=scale,
    )[0].squeeze(0)  # fmt: skip


@pytest.mark.parametrize(("lengths", "dim"), [((640,) * 8, 128), ((1, 37, 640, 250, 1000), 128), ((300, 129), 64)])
def test_flash_backward_is_the_efficient_kernels_gradient(lengths, dim):
    """``causal_varlen`` under autograd: the forward is the memory-efficient kernel's, bit for bit (the engine's
    numbers); the gradients, by FlashAttention-2's backward from that forward's output and log-sum-exp, equal the
    memory-efficient kernel's own backward to bf16 rounding (and are as close as it to an fp32 reference)."""
    from rlrun.kernels import attention as attention_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(lengths)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    max_len, scale = max(lengths), dim**-0.5
    leaves = [
        torch.randn(tokens, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    ]
    grad_out = torch.randn(tokens, HEADS, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    def run(fn, dtype):
        inputs = [t.detach().to(dtype).clone().requires_grad_(True) for t in leaves]
        out = fn(*inputs)
        out.backward(grad_out.to(dtype))
        return out.detach(), *(t.grad for t in inputs)

    assert attention_kernel.flash_backward_covers(*(t.detach().requires_grad_(True) for t in leaves))
    got = run(lambda q, k, v: attention_kernel.causal_varlen(q, k, v, bounds, max_len, scale), torch.bfloat16)
    ref = run(lambda q, k, v: _efficient_reference(q, k, v, bounds, max_len, scale), torch.bfloat16)
    exact = run(lambda q, k, v: _efficient_reference(q, k, v, bounds, max_len, scale), torch.float32)
    assert torch.equal(got[0], ref[0])
    for name, g, r, e in zip(("query", "key", "value"), got[1:], ref[1:], exact[1:], strict=True):
        assert g.shape == r.shape and torch.isfinite(g).all(), name
        own = (g.float() - e).abs().max().item()
        theirs = (r.float() - e).abs().max().item()
        assert own <= 2 * theirs + 1e-3, (name, own, theirs)
        assert (g.float() - r.float()).abs().max().item() <= 0.05 * e.abs().max().item(), name
