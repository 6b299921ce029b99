"""The embedded engine's fused RMSNorm against transformers' own norm forward (the independent reference),
and which norms it leaves alone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlrun.engine.embedded.fused_norm import fuse_rms_norms


class OnePlusWeightRMSNorm(torch.nn.Module):
    """Gemma's formula (``1 + weight``): not Llama's, so it must keep its own forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(dim))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_compute_transformers_norms(tiny_model_dirs, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=dtype).eval()
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    for m in norms:  # non-trivial weights: a unit weight would hide a missing or misplaced multiply
        m.weight.data.copy_(torch.randn_like(m.weight, dtype=torch.float32).to(dtype))
    inputs = [torch.randn(3, 5, m.weight.shape[0], dtype=torch.float32).mul(4).to(dtype) for m in norms]
    with torch.no_grad():
        want = [m(x) for m, x in zip(norms, inputs, strict=False)]
        assert fuse_rms_norms(model) == len(norms) == 4 * model.config.num_hidden_layers + 1
        got = [m(x) for m, x in zip(norms, inputs, strict=False)]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}  # one bf16 rounding
    for g, w in zip(got, want, strict=False):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w.float(), **tol)


def test_other_norm_formulas_keep_their_forward():
    norm = OnePlusWeightRMSNorm(8)
    x = torch.randn(2, 8)
    want = norm(x)
    assert fuse_rms_norms(torch.nn.Sequential(norm)) == 0
    torch.testing.assert_close(norm(x), want)
