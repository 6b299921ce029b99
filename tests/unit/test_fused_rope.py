"""Which models get the fused RoPE, and that everything the kernel does not cover goes to transformers' own
function. The kernel itself is CUDA-only (Triton): tests/gpu/test_triton_kernels_gpu.py checks it bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch

from rlrun.engine.embedded import fused_rope
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize(
    ("family", "llama_formula"),
    [("llama", True), ("qwen3", True), ("mistral", True), ("qwen3_moe", True), ("glm4_moe", False), ("phi3", False)],
)
def test_only_llama_formula_modules_are_fused(family, llama_formula):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    assert fused_rope.has_llama_rope(module) is llama_formula


def test_a_cpu_model_keeps_transformers_rope(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen3", tmp_path / "m"))
    before = modeling_qwen3.apply_rotary_pos_emb
    assert fused_rope.fuse_rotary(model) == 0
    assert modeling_qwen3.apply_rotary_pos_emb is before


def test_unfused_gives_a_model_transformers_rope_back_while_inside(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model("qwen3", tmp_path / "m"))
    original = modeling_qwen3.apply_rotary_pos_emb
    swapped = fused_rope._fused(original)  # as fuse_rotary leaves it on CUDA
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", swapped)
    with fused_rope.unfused(model):
        assert modeling_qwen3.apply_rotary_pos_emb is original
    assert modeling_qwen3.apply_rotary_pos_emb is swapped


def test_calls_the_kernel_does_not_cover_go_to_the_original():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs)
        return apply_rotary_pos_emb(*args, **kwargs)

    fused = fused_rope._fused(original)
    q, k = torch.randn(2, 3, 4, 8).transpose(1, 2), torch.randn(2, 2, 3, 8)  # [B, H, S, D]
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    expected = apply_rotary_pos_emb(q, k, cos, sin)
    for kwargs in ({}, {"unsqueeze_dim": 1}):  # CPU tensors
        got = fused(q, k, cos, sin, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert len(calls) == 2
    assert not fused_rope.kernel_covers(q, k, cos, sin, 1)  # on CPU
    assert fused._rlrun_original is original


def test_the_wrapper_hands_kernel_covers_the_callers_unsqueeze_dim_and_keeps_other_calls(monkeypatch):
    """The wrapper's own routing, with the layout check and the kernel (CUDA only) standing in: the caller's
    ``unsqueeze_dim`` (positional or keyword) reaches ``kernel_covers``; any other argument means the original."""
    seen = []
    monkeypatch.setattr(fused_rope, "kernel_covers", lambda q, k, cos, sin, dim: seen.append(dim) or dim == 1)
    monkeypatch.setattr(fused_rope, "rope_qk", lambda q, k, cos, sin: "kernel")
    fused = fused_rope._fused(lambda *args, **kwargs: "original")
    q = k = cos = sin = torch.zeros(1)
    assert [fused(q, k, cos, sin), fused(q, k, cos, sin, 1), fused(q, k, cos, sin, unsqueeze_dim=1)] == ["kernel"] * 3
    assert fused(q, k, cos, sin, 2) == fused(q, k, cos, sin, unsqueeze_dim=2) == "original"
    assert seen == [1, 1, 1, 2, 2]
    assert fused(q, k, cos, sin, 1, None) == fused(q, k, cos, sin, position_ids=None) == "original"
    assert seen == [1, 1, 1, 2, 2]  # not even asked
