"""The per-head QK-norm that trainer and engine share (rlrun/head_norm.py): which side runs what, its backward
against autograd through ``F.rms_norm`` (the independent reference), and, where Triton is installed, the kernel under
Triton's interpreter (the two sides' layouts bitwise in bf16 is a GPU question: tests/gpu/test_head_norm_gpu.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rlrun.engine.backends import fused_norm
from rlrun.head_norm import HeadNorm, kernel_takes, rms_norm_backward, rms_norm_heads

REPO = Path(__file__).resolve().parents[2]


def test_off_cuda_both_sides_run_torchs_rms_norm():
    x, w = torch.randn(3, 4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    assert not kernel_takes(x)
    assert torch.equal(rms_norm_heads(x, w, 1e-6), F.rms_norm(x, (16,), w, 1e-6))


def test_the_backward_is_rms_norms_gradient():
    x = torch.randn(2, 3, 4, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, 4, 32, dtype=torch.float64)
    F.rms_norm(x, (32,), w, 1e-6).backward(grad)
    got_x, got_w = rms_norm_backward(x.detach(), w.detach(), 1e-6, grad)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-6, atol=1e-6)  # fp32 arithmetic inside
    torch.testing.assert_close(got_w, w.grad, rtol=1e-5, atol=1e-5)


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


def test_the_engines_head_norms_get_the_shared_forward(tiny_model_dirs):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.float32).eval()
    fused_norm.fuse_rms_norms(model)
    forwards = {name.rsplit(".", 1)[-1]: m.forward.__func__ for name, m in model.named_modules() if "norm" in name}
    assert forwards["q_norm"] is forwards["k_norm"] is fused_norm._head_forward
    assert forwards["input_layernorm"] is forwards["post_attention_layernorm"] is fused_norm._fused_forward


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_the_kernel_under_tritons_interpreter():
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    script = Path(__file__).parent / "head_norm_interpreted.py"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
