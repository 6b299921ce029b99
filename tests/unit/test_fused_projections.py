"""The fused q/k/v and gate/up projections against transformers' own unfused model (the independent reference),
and the engine's weight loading, checksums and offload through them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.embedded.fused_projections import FusedProjection, ProjectionPart, fuse_projections


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_computes_the_unfused_logits(tiny_model_dirs, kind, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[kind], dtype=dtype).eval()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        slices = fuse_projections(model)
        got = model(ids).logits
    qkv_bias = 3 if kind == "qwen2" else 0  # Qwen2's q/k/v have biases, fused along with the weights
    assert len(slices) == layers * (3 + 2 + qkv_bias)
    assert sum(isinstance(m, FusedProjection) for m in model.modules()) == 2 * layers
    assert sum(isinstance(m, ProjectionPart) for m in model.modules()) == 5 * layers
    assert torch.equal(got, want)  # each column is the same dot product: bitwise on CPU


def test_a_part_called_out_of_turn_computes_its_own_rows():
    parts = [torch.nn.Linear(6, n, bias=True) for n in (4, 2, 2)]
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    fused = FusedProjection(parts)
    q, k, v = (ProjectionPart(fused, i) for i in range(3))
    assert torch.equal(k.weight, parts[1].weight) and torch.equal(v.bias, parts[2].bias)  # views, for readers
    with torch.no_grad():
        torch.testing.assert_close(q(x), parts[0](x))
        torch.testing.assert_close(k(y), parts[1](y))  # another input: not x's fused output
        torch.testing.assert_close(k(y), parts[1](y))  # twice on the same input
        torch.testing.assert_close(v(x), parts[2](x))  # x's output was dropped for y's: recomputed
        torch.testing.assert_close(q(y), parts[0](y))


def test_mismatched_linears_are_left_alone():
    block = torch.nn.Module()
    block.gate_proj = torch.nn.Linear(8, 4, bias=False)
    block.up_proj = torch.nn.Linear(8, 4, bias=True)  # one with a bias, one without
    block.q_proj, block.k_proj, block.v_proj = (torch.nn.Linear(8, 8) for _ in range(3))
    block.v_proj = block.v_proj.to(torch.float64)
    assert fuse_projections(block) == {}
    assert type(block.up_proj) is torch.nn.Linear and type(block.q_proj) is torch.nn.Linear


def test_engine_loads_and_checksums_weights_under_their_checkpoint_names(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], dtype="float32")
    attn = engine.model.model.layers[1].self_attn
    mlp = engine.model.model.layers[0].mlp
    named = engine.named_parameters()
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in named)
    assert torch.equal(
        named["model.layers.1.self_attn.q_proj.weight"], attn.qkv_proj.weight[: attn.q_proj.out_features]
    )
    bias_before, gate_up_before = attn.qkv_proj.bias.clone(), mlp.gate_up_proj.weight.clone()
    new_up = torch.randn_like(named["model.layers.0.mlp.up_proj.weight"])
    new_k_bias = torch.randn_like(named["model.layers.1.self_attn.k_proj.bias"])
    engine.load_weights(
        [("model.layers.0.mlp.up_proj.weight", new_up), ("model.layers.1.self_attn.k_proj.bias", new_k_bias)]
    )
    rows, q_rows, k_rows = mlp.up_proj.out_features, attn.q_proj.out_features, attn.k_proj.out_features
    assert torch.equal(mlp.gate_up_proj.weight[rows:], new_up)
    assert torch.equal(mlp.gate_up_proj.weight[:rows], gate_up_before[:rows])  # the gate rows are untouched
    assert torch.equal(attn.qkv_proj.bias[q_rows : q_rows + k_rows], new_k_bias)
    assert torch.equal(attn.qkv_proj.bias[:q_rows], bias_before[:q_rows])
    assert torch.equal(attn.qkv_proj.bias[q_rows + k_rows :], bias_before[q_rows + k_rows :])
    assert torch.equal(engine.named_parameters()["model.layers.1.self_attn.k_proj.bias"], new_k_bias)
    with pytest.raises(ValueError, match="shape of weight model.layers.0.mlp.gate_proj.weight"):
        engine.load_weights([("model.layers.0.mlp.gate_proj.weight", torch.zeros(3, 3))])
