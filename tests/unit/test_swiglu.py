"""The SwiGLU kernel's callers on CPU (no Triton here; tests/gpu/test_swiglu_gpu.py runs the kernel): the trainer's
patched Megatron MLP leaves CPU tensors and every configuration it does not cover on Megatron's own path, and its
kernel path (with eager stand-ins for the kernel) computes Megatron's MLP; the engine picks only Llama-formula SiLU
MLPs with fused gate/up projections, and its forward on the fused output is the MLP's own."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from dist_utils import run_distributed
from swiglu_cases import eager_swiglu, mlp_comparison, mlp_config


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "ffn", "bias"), [("bfloat16", 96, False), ("float32", 37, True)])
def test_cpu_calls_keep_megatrons_path(dtype, ffn, bias):
    out = run_distributed(mlp_comparison, 1, "cpu", dtype, ffn, bias)
    assert out["forward_bits"] and out["bias"] and out["scaled_equal"] is (None if bias else True)
    assert all(e == 0.0 for e in out["grad_relative_errors"].values()), out["grad_relative_errors"]
    assert out["kernel_calls"] == out["scaled_kernel_calls"] == 0


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "ffn", "bias"), [("bfloat16", 96, False), ("float32", 37, True)])
def test_kernel_path_computes_megatrons_mlp(dtype, ffn, bias):
    """The wrapper's own forward (fc1, bias, the kernel's Function, fc2) with eager stand-ins for the kernel: the
    same forward bits as Megatron's, gradients to its rounding (the stand-in backward is fp32, rounded once)."""
    out = run_distributed(mlp_comparison, 1, "cpu", dtype, ffn, bias, True)
    assert out["kernel_calls"] == 1 and out["scaled_kernel_calls"] == 0
    assert out["forward_bits"] and out["bias"] and out["scaled_equal"] is (None if bias else True)
    assert {"input", "linear_fc1.weight", "linear_fc2.weight"} <= set(out["grad_names"])
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    assert all(e <= tol for e in out["grad_relative_errors"].values()), out["grad_relative_errors"]


@pytest.mark.parametrize(
    ("overrides", "covered"),
    [
        ({}, True),
        ({"add_bias_linear": True}, True),  # the bias is added before the glu, as Megatron does
        ({"activation_func": F.gelu}, False),
        ({"gated_linear_unit": False}, False),
        ({"activation_func_clamp_value": 7.0}, False),
        ({"glu_linear_offset": 1.0}, False),
        ({"bias_activation_fusion": True}, False),
    ],
)
def test_only_the_plain_gated_silu_is_covered(overrides, covered):
    from rlrun.megatron.swiglu_apply import plain_swiglu

    config = mlp_config(torch.float32, 32, **overrides)
    assert plain_swiglu(types.SimpleNamespace(config=config)) is covered


def test_kernel_covers_cuda_tensors_only():
    from rlrun.megatron.swiglu_apply import kernel_covers

    assert not kernel_covers(torch.zeros(2, 3, dtype=torch.bfloat16))


def _fused_qwen3(tiny_model_dirs):
    from rlrun.engine.embedded.fused_projections import fuse_projections

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen3"], dtype=torch.float32).eval()
    mlps = [m for m in model.modules() if type(m).__name__ == "Qwen3MLP"]
    assert mlps
    return model, mlps, fuse_projections


def test_engine_fuses_llama_silu_mlps_with_fused_projections_only(tiny_model_dirs):
    from rlrun.engine.embedded.fused_swiglu import fusable, fuse_swiglu

    model, mlps, fuse_projections = _fused_qwen3(tiny_model_dirs)
    assert not any(fusable(m) for m in mlps)  # separate gate/up linears: nothing to read fused
    fuse_projections(model)
    assert all(fusable(m) for m in mlps)
    mlps[0].act_fn = torch.nn.GELU()  # another activation (Gemma's MLP has Llama's forward with GELU)
    assert not fusable(mlps[0])
    other = type("OtherMLP", (torch.nn.Module,), {"forward": lambda self, x: x})()  # another formula
    other.gate_up_proj, other.gate_proj, other.up_proj = mlps[1].gate_up_proj, mlps[1].gate_proj, mlps[1].up_proj
    other.act_fn = mlps[1].act_fn
    assert not fusable(other)
    assert fuse_swiglu(model) == 0  # CPU: no kernel
    assert all("forward" not in vars(m) for m in mlps)


def test_engine_forward_on_the_fused_output_is_the_mlps_own(tiny_model_dirs, monkeypatch):
    """The kernel's forward with an eager stand-in for the kernel: bitwise the MLP's own forward (the same GEMM,
    then the same SiLU and multiply), and the MLP's own forward where the kernel does not cover the call."""
    from rlrun.engine.embedded import fused_swiglu

    model, mlps, fuse_projections = _fused_qwen3(tiny_model_dirs)
    fuse_projections(model)
    mlp = mlps[0]
    covers = fused_swiglu.kernel_covers
    x = torch.randn(3, 5, mlp.gate_up_proj.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mlp(x)
        calls = []
        monkeypatch.setattr(fused_swiglu, "kernel_covers", lambda x, w: True)
        monkeypatch.setattr(fused_swiglu, "swiglu", lambda gate_up: calls.append(1) or eager_swiglu(gate_up))
        got = fused_swiglu._fused_forward(mlp, x)
        assert calls and torch.equal(got, want)
        monkeypatch.setattr(fused_swiglu, "kernel_covers", lambda x, w: False)
        assert torch.equal(fused_swiglu._fused_forward(mlp, x), want) and len(calls) == 1
    assert not covers(x, mlp.gate_up_proj.weight)  # the real check: a CPU tensor
