"""HF config.json -> ModelArch / TransformerConfig, including a SmolLM2-135M-shaped config (no weights)."""

from __future__ import annotations

import json
import math

import pytest

from rlrun.megatron.hf_config import ModelArch, head_padding_note, model_features, transformer_config

# SmolLM2-135M-Instruct's config.json fields that matter (9 heads / 3 KV heads, tied, rope_theta 1e5).
SMOLLM2 = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}


def test_tiny_families_are_read_from_disk(tiny_model_dirs):
    llama, qwen2, qwen3 = (ModelArch.from_hf_dir(tiny_model_dirs[k]) for k in ("llama", "qwen2", "qwen3"))
    raw = {k: json.loads((tiny_model_dirs[k] / "config.json").read_text()) for k in tiny_model_dirs}
    assert (llama.tie_embeddings, llama.qkv_bias, llama.qk_norm) == (True, False, False)
    assert (qwen2.tie_embeddings, qwen2.qkv_bias, qwen2.qk_norm) == (False, True, False)
    assert (qwen3.tie_embeddings, qwen3.qkv_bias, qwen3.qk_norm) == (False, False, True)
    for kind, arch in (("llama", llama), ("qwen2", qwen2), ("qwen3", qwen3)):
        assert arch.rope_theta == raw[kind]["rope_parameters"]["rope_theta"]
        assert arch.rms_norm_eps == raw[kind]["rms_norm_eps"]
        assert arch.vocab_size == raw[kind]["vocab_size"]
        assert arch.num_kv_heads == raw[kind]["num_key_value_heads"]


def test_smollm2_shapes_at_tp1_and_tp3():
    arch = ModelArch.from_dict(SMOLLM2)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.rope_theta) == (9, 3, 64, 1e5)
    assert arch.tie_embeddings
    for tp in (1, 3):
        config = transformer_config(arch, tp=tp, pp=1, dtype="bfloat16")
        assert (config.num_attention_heads, config.num_query_groups, config.kv_channels) == (9, 3, 64)
        assert config.ffn_hidden_size == 1536 and config.gated_linear_unit and config.normalization == "RMSNorm"
        assert config.hidden_dropout == 0 and config.attention_dropout == 0
        padded = arch.padded_vocab_size(tp)
        assert padded >= 49152 and padded % (128 * tp) == 0 and padded - 49152 < 128 * tp


@pytest.mark.parametrize("tp, groups", [(2, 4), (4, 4), (5, 5), (6, 6)])
def test_smollm2_heads_are_padded_to_whole_groups_per_rank(tp, groups):
    """3 KV groups of 3 heads at a TP that does not divide 3: inert groups of 3 heads up to a multiple of tp."""
    arch = ModelArch.from_dict(SMOLLM2)
    config = transformer_config(arch, tp=tp, pp=1, dtype="float32")
    assert (config.num_query_groups, config.num_attention_heads, config.kv_channels) == (groups, 3 * groups, 64)
    assert config.num_query_groups % tp == 0 and config.num_attention_heads % tp == 0
    assert config.hidden_size == 576  # hidden stays; kv_channels keeps each head 64 wide


def test_padding_note_states_the_cost():
    arch = ModelArch.from_dict(SMOLLM2)
    assert head_padding_note(arch, 1) is None and head_padding_note(arch, 3) is None
    # One layer's weights, counted by hand: q (9 heads), k and v (3 each), o (9 heads), then gate/up/down.
    hidden, ffn, head = 576, 1536, 64
    unpadded = (9 + 3 + 3 + 9) * head * hidden + 3 * hidden * ffn
    padded = (12 + 4 + 4 + 12) * head * hidden + 3 * hidden * ffn
    note = head_padding_note(arch, 2)
    assert "9 -> 12 query heads" in note and "3 -> 4 key/value heads" in note
    assert f"+{padded / unpadded - 1:.1%} decoder-layer matmul work" in note and "+33% attention-score" in note


def test_heads_not_a_multiple_of_kv_heads_are_refused():
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) must be a multiple of num_key_value_heads \(2\)"):
        ModelArch.from_dict({**SMOLLM2, "num_key_value_heads": 2})


def test_vocab_padding_is_minimal_multiple():
    arch = ModelArch.from_dict({**SMOLLM2, "vocab_size": 264})
    assert [arch.padded_vocab_size(tp) for tp in (1, 2, 3)] == [384, 512, 384]


@pytest.mark.parametrize(
    "override, field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_configs_name_the_field(override, field):
    with pytest.raises(ValueError, match=f"config.json: {field} "):
        ModelArch.from_dict({**SMOLLM2, **override})


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="model.dtype"):
        transformer_config(ModelArch.from_dict(SMOLLM2), tp=1, pp=1, dtype="float16")


@pytest.mark.parametrize("window", [None, 8192, 131072])
def test_mistral_window_at_least_max_positions_is_full_attention(window):
    arch = ModelArch.from_dict({**SMOLLM2, "model_type": "mistral", "sliding_window": window, "head_dim": 128})
    assert arch.model_type == "mistral" and arch.head_dim == 128 and not arch.qkv_bias and not arch.qk_norm


def test_mistral_short_window_names_the_fix():
    with pytest.raises(
        ValueError,
        match=r"sliding_window \(4096\) must be null or a window of at least "
        r"max_position_embeddings \(8192\) because attention is built as full",
    ):
        ModelArch.from_dict({**SMOLLM2, "model_type": "mistral", "sliding_window": 4096})


def test_yarn_sets_the_softmax_scale_and_llama3_does_not():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    config = transformer_config(ModelArch.from_dict({**SMOLLM2, "rope_scaling": yarn}), tp=1, pp=1, dtype="float32")
    assert config.softmax_scale == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / 8.0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    arch = ModelArch.from_dict({**SMOLLM2, "rope_scaling": llama3})
    assert transformer_config(arch, tp=1, pp=1, dtype="float32").softmax_scale is None
    assert arch.rope.rope_type == "llama3" and arch.rope.original_max_position_embeddings == 8192


GLM45 = {
    "model_type": "glm4_moe",
    "hidden_size": 96,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 16,
    "vocab_size": 300,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.5},
    "attention_bias": True,
    "use_qk_norm": False,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}


def test_glm45_moe_config():
    arch = ModelArch.from_dict(GLM45)
    assert (arch.qkv_bias, arch.qk_norm, arch.rope.dim, arch.rope.rotary_percent) == (True, False, 8, 0.5)
    assert arch.moe.moe_layers == (False, True, True) and arch.moe.shared_expert_ffn_hidden_size == 64
    config = transformer_config(arch, tp=1, pp=1, dtype="float32", ep=2)
    assert config.moe_router_score_function == "sigmoid" and config.moe_router_enable_expert_bias
    assert config.moe_router_bias_update_rate == 0.0 and config.moe_router_topk_scaling_factor == 2.5
    assert config.moe_router_num_groups is None and not config.moe_shared_expert_gate
    assert config.moe_shared_expert_intermediate_size == 64 and config.moe_layer_freq == [0, 1, 1]
    grouped = ModelArch.from_dict({**GLM45, "n_group": 4, "topk_group": 2})
    assert (grouped.moe.num_groups, grouped.moe.group_topk) == (4, 2)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"norm_topk_prob": False}, r"norm_topk_prob \(False\) must be true because Megatron's sigmoid router"),
        ({"n_group": 4, "topk_group": 1}, r"num_experts_per_tok // topk_group \(4 // 1\) must be 2"),
    ],
)
def test_glm45_routing_megatron_cannot_express_is_refused(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_dict({**GLM45, **override})
    routing = {f.name: f for f in model_features({**GLM45, **override})}["MoE routing"]
    assert not routing.supported and routing.error.args[0].startswith("config.json: ")


def test_glm45_features_name_the_routing():
    features = {f.name: f for f in model_features(GLM45)}
    assert all(f.supported for f in features.values())
    assert features["MoE routing"].detail == (
        "8 experts, top-4, sigmoid + correction bias, scaling 2.5, shared expert, 1 dense layer(s)"
    )
    assert features["attention"].detail == "6 query heads, 3 key/value heads, q/k/v bias"
    assert "50%" in features["partial rotary"].detail


DEEPSEEK_V3 = {
    **{k: v for k, v in GLM45.items() if k not in ("attention_bias", "use_qk_norm", "head_dim")},
    "model_type": "deepseek_v3",
    "num_key_value_heads": 6,
    "rms_norm_eps": 1e-6,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "head_dim": 8,
    "n_group": 4,
    "topk_group": 2,
    "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 1e4},
}  # fmt: skip


def test_deepseek_v3_config_is_multi_latent_attention():
    arch = ModelArch.from_dict(DEEPSEEK_V3)
    assert arch.rope is None and arch.mla.rope_type == "yarn" and arch.mla.rope_interleave
    config = transformer_config(arch, tp=1, pp=1, dtype="float32", ep=2)
    assert type(config).__name__ == "MLATransformerConfig" and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim) == (24, 16, 12, 8)
    assert (config.v_head_dim, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == (10, 40, 1, 1)
    assert config.softmax_scale is None  # MLA computes its own (mscale_all_dim), as transformers does
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (4, 2)
    features = {f.name: f for f in model_features(DEEPSEEK_V3)}
    assert features["attention"].detail.startswith("multi-latent, 6 heads, q_lora_rank 24, kv_lora_rank 16")
    # transformers takes the plain YaRN factor when mscale is unset: Megatron gets (1, 0), the same value.
    plain = {**DEEPSEEK_V3, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}
    assert (ModelArch.from_dict(plain).mla.mscale, ModelArch.from_dict(plain).mla.mscale_all_dim) == (1.0, 0.0)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"rms_norm_eps": 1e-5}, r"rms_norm_eps \(1e-05\) must be 1e-6 because transformers' q/kv latent norms"),
        ({"attention_bias": True}, r"attention_bias \(True\) must be false"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2, "rope_theta": 1e4}},
         r"rope_parameters .* must give factor, and no attention_factor"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0, "rope_theta": 1e4}},
         r"rope_parameters.mscale \(None\) must be set when mscale_all_dim is"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 4.0, "rope_theta": 1e4}}, r"be 'default' or 'yarn'"),
    ],
)  # fmt: skip
def test_deepseek_v3_variants_megatron_cannot_express_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        ModelArch.from_dict({**DEEPSEEK_V3, **override})


def test_deepseek_v3_needs_tp1():
    with pytest.raises(ValueError, match=r"parallel.tp \(2\) must be 1 for"):
        transformer_config(ModelArch.from_dict(DEEPSEEK_V3), tp=2, pp=1, dtype="float32")
