"""The per-head QK-norm that trainer and engine share (rlrun/kernels/head_norm.py): which side runs what, its backward
against autograd through ``F.rms_norm`` (the independent reference), and, where Triton is installed, the kernel under
Triton's interpreter (the two sides' layouts bitwise in bf16 is a GPU question: tests/gpu/test_head_norm_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from interpreted import needs_triton, run_interpreted
from rlrun.engine.embedded import fused_norm
from rlrun.kernels.head_norm import HeadNorm, kernel_takes, rms_norm_heads
from rlrun.kernels.shared_norm import KernelRmsNorm


def test_off_cuda_both_sides_run_torchs_rms_norm():
    x, w = torch.randn(3, 4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    assert not kernel_takes(x)
    assert torch.equal(rms_norm_heads(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))


@pytest.mark.parametrize("needs_w", [True, False])
def test_a_kernel_norms_backward_is_autograd_through_rms_norm(needs_w):
    """Whatever the kernel's forward (here a stand-in that doubles), the gradients are ``F.rms_norm``'s from the saved
    input; a weight without a gradient gets none."""
    x = torch.randn(2, 3, 4, 32, dtype=torch.float64)
    w = torch.randn(32, dtype=torch.float64)
    grad = torch.randn(2, 3, 4, 32, dtype=torch.float64)
    ours = [x.clone().requires_grad_(), w.clone().requires_grad_(needs_w)]
    out = KernelRmsNorm.apply(lambda a, b, eps: 2 * F.rms_norm(a, (32,), b, eps), *ours, 1e-6)
    torch.testing.assert_close(out, 2 * F.rms_norm(x, (32,), w, 1e-6))
    out.backward(grad)
    ref = [x.clone().requires_grad_(), w.clone().requires_grad_(needs_w)]
    F.rms_norm(ref[0], (32,), ref[1], 1e-6).backward(grad)
    torch.testing.assert_close(ours[0].grad, ref[0].grad, rtol=0, atol=0)
    assert (ours[1].grad is None) if not needs_w else torch.equal(ours[1].grad, ref[1].grad)


def test_megatrons_head_norm_is_torchs_rmsnorm_with_the_shared_forward():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    norm = HeadNorm(config=config, hidden_size=16, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and dict(norm.named_parameters()).keys() == {"weight"}
    norm.weight.data.normal_()
    x = torch.randn(5, 2, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, 1e-6), rtol=0, atol=0)
    with pytest.raises(ValueError, match="normalization \\(LayerNorm\\) must be RMSNorm"):
        HeadNorm(config=TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), hidden_size=16)


def test_the_engines_head_and_hidden_norms_get_the_shared_forwards(tiny_model_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.float32).eval()
    fused_norm.fuse_rms_norms(model)
    forwards = {name.rsplit(".", 1)[-1]: m.forward.__func__ for name, m in model.named_modules() if "norm" in name}
    assert forwards["q_norm"] is forwards["k_norm"] is fused_norm._head_forward
    assert forwards["input_layernorm"] is forwards["post_attention_layernorm"] is fused_norm._hidden_forward
    assert forwards["norm"] is fused_norm._fused_forward  # the final norm: F.rms_norm, as Megatron's final_layernorm


def test_the_engines_decode_queries_and_keys_are_read_in_place(tiny_model_dirs):
    """The q/k norms' inputs of a decode step ([B, 1, heads, D] views of the fused q/k/v output, whose size-1 dimension
    carries a stride of its own) are rows the kernel reads without a copy; so are Megatron's (sequence, batch 1)."""
    from rlrun.engine.embedded.fused_projections import fuse_projections
    from rlrun.kernels.shared_norm import aligned_rows

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.bfloat16).eval()
    fuse_projections(model)
    seen = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in fused_norm.HEAD_NORMS:
            module.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    with torch.no_grad():
        model(torch.zeros(8, 1, dtype=torch.long))  # one decode position of 8 rows
    assert len(seen) == 2 * model.config.num_hidden_layers
    for x in seen:
        assert not x.is_contiguous() and x.shape[1] == 1
        rows = aligned_rows(x)
        assert rows is not None and rows.data_ptr() == x.data_ptr(), (x.shape, x.stride())
        assert torch.equal(rows, x.reshape(rows.shape))
    megatron_keys = torch.zeros(5, 1, 2, 3 * 16)[..., 16:32]  # a strided slice of mixed_qkv [s, b, groups, ...]
    assert aligned_rows(megatron_keys) is not None
    assert aligned_rows(torch.zeros(4, 3, 16)[:, :, 1:9]) is None  # a row start off the 8-element grid: copied
    assert aligned_rows(torch.zeros(4, 3, 2, 16).transpose(0, 1)) is None  # rows that flatten to no single stride


@needs_triton
def test_the_kernel_under_tritons_interpreter():
    run_interpreted("head_norm_interpreted.py")
