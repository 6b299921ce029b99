"""The hidden-state norms that trainer and engine share (rlrun/kernels/hidden_norm.py): which side runs what, Megatron's
module, the engine's names, and, where Triton is installed, the kernel and its gradients under Triton's interpreter
(the two sides bitwise in bf16 is a GPU question: tests/gpu/test_hidden_norm_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from interpreted import needs_triton, run_interpreted
from rlrun.kernels.hidden_norm import HiddenNorm, kernel_takes, rms_norm_hidden


def test_off_cuda_both_sides_run_torchs_rms_norm():
    x, w = torch.randn(3, 4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert not kernel_takes(x)
    assert torch.equal(rms_norm_hidden(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))


def test_megatrons_hidden_norm_is_torchs_rmsnorm_with_the_shared_forward():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    norm = HiddenNorm(config=config, hidden_size=64, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and dict(norm.named_parameters()).keys() == {"weight"}
    norm.weight.data.normal_()
    x = torch.randn(5, 2, 64)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6), rtol=0, atol=0)
    with pytest.raises(ValueError, match="normalization \\(LayerNorm\\) must be RMSNorm"):
        HiddenNorm(config=TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4), hidden_size=64)
    sequence_parallel = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", tensor_model_parallel_size=2,
        sequence_parallel=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sequence_parallel must be off because HiddenNorm"):
        HiddenNorm(config=sequence_parallel, hidden_size=64)


@needs_triton
def test_the_kernel_under_tritons_interpreter():
    run_interpreted("hidden_norm_interpreted.py")


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_the_engines_decoder_layers_add_and_normalise_in_one_step_with_the_same_logits(tiny_model_dirs, kind):
    """Off CUDA the fused layer runs the add and the norm as two steps: the logits are the unfused layer's, bit for
    bit (on CUDA in bf16 the one launch against the two: tests/gpu/test_hidden_norm_gpu.py)."""
    from transformers import AutoModelForCausalLM

    from rlrun.engine.embedded import fused_norm

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[kind], dtype=torch.float32).eval()
    fused_norm.fuse_rms_norms(model)
    tokens = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(tokens).logits
        assert fused_norm.fuse_residual_norms(model) == model.config.num_hidden_layers
        got = model(tokens).logits
    assert torch.equal(got, want)
    layer = model.model.layers[0]
    assert layer.forward.__func__ is fused_norm._add_norm_layer_forward
