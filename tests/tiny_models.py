"""Tiny random Hugging Face models built from real configs (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, and the
scaled-RoPE / Mistral variants of ``FAMILY_KINDS``),
saved as real HF directories (config.json + safetensors + tokenizer with a ChatML template), for tests.

Every parameter is perturbed (biases and norm weights included) so a wrong mapping cannot hide
behind zeros or ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer():
    """A byte-level BPE with no merges (every UTF-8 byte is a token) plus ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


FAMILY_KINDS = {
    "llama3": False,
    "llama_linear": True,
    "qwen2_yarn": False,
    "qwen3_yarn": True,
    "mistral": False,
}
"""The RoPE-scaling and Mistral kinds of :func:`tiny_config` and whether each ties its embeddings. Each has
6 query heads in 3 key/value groups (TP=2 pads them to 4 groups) and a low ``rope_theta`` or a short
``original_max_position_embeddings`` so that the scaling changes the frequencies a 10-token row uses."""


def tiny_config(kind: str, vocab_size: int = 264, tie: bool = False):
    """A 2-layer config of the given family with GQA (4 query heads, 2 KV heads; 6 and 3 for ``FAMILY_KINDS``)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        bos_token_id=256,
        eos_token_id=258,
        pad_token_id=256,
    )
    if kind == "llama":
        return LlamaConfig(rope_theta=10000.0, rms_norm_eps=1e-5, **common)
    if kind in FAMILY_KINDS:
        heads = {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "hidden_size": 96}
        return _family_config(kind, {**common, **heads})
    if kind == "qwen2":
        return Qwen2Config(rope_theta=1000000.0, rms_norm_eps=1e-6, **common)
    if kind == "qwen3":
        return Qwen3Config(rope_theta=1000000.0, rms_norm_eps=1e-6, head_dim=16, **common)
    if kind == "qwen3_moe":
        # 4 experts, top-2, softmax over all experts without renormalising the top 2 (Qwen3-MoE's
        # norm_topk_prob=False routing; a config override flips it). save_pretrained writes the
        # per-expert tensors (model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight) real checkpoints use.
        return Qwen3MoeConfig(
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            router_aux_loss_coef=0.01,
            **common,
        )
    if kind == "qwen2_moe":
        # QKV bias, 4 experts top-2 and a gated shared expert every token goes through.
        return Qwen2MoeConfig(
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            router_aux_loss_coef=0.01,
            **common,
        )
    if kind == "glm4_moe":
        return _glm4_moe_config(common)
    if kind == "deepseek_v3":
        return _deepseek_v3_config(common)
    raise ValueError(
        f"unknown tiny model kind {kind!r}; expected llama, qwen2, qwen3, qwen3_moe, qwen2_moe, glm4_moe or one of "
        f"{FAMILY_KINDS}"
    )


def _deepseek_v3_config(common: dict):
    """DeepSeek-V3: multi-latent attention (q_lora_rank 24, kv_lora_rank 16, per head 12 + 8 query/key and 10
    value channels, interleaved RoPE with YaRN factor 4 and mscale / mscale_all_dim 1.0 / 0.8), layer 0 dense,
    layer 1 MoE (8 experts top-4 from the best 2 of 4 groups, sigmoid + correction bias, one shared expert)."""
    from transformers import DeepseekV3Config

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
            "mscale_all_dim": 0.8, "rope_theta": 1000.0}  # fmt: skip
    common = {**common, "num_key_value_heads": common["num_attention_heads"]}
    return DeepseekV3Config(
        rope_parameters=rope,
        rms_norm_eps=1e-6,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        **common,
    )


def _glm4_moe_config(common: dict):
    """GLM-4.5 MoE: layer 0 dense, layer 1 MoE (4 experts top-2, sigmoid + correction bias, scaling 2.5, one
    shared expert); q/k/v bias, QK-norm, RoPE on half of each 16-channel head; 6 query heads in 3 groups."""
    from transformers import Glm4MoeConfig

    common = {**common, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}
    return Glm4MoeConfig(
        head_dim=16,
        rope_parameters={"rope_theta": 1000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
        rms_norm_eps=1e-5,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
        **common,
    )


def _family_config(kind: str, common: dict):
    """Llama 3.1-style (llama3 RoPE with non-default low/high/original values), linear RoPE, Qwen2.5/Qwen3 YaRN
    (attention factor 0.1 ln 4 + 1), all with hidden 96; and Mistral with hidden 64 (explicit head_dim:
    6 x 16 = 96 != 64, as Mistral-Nemo's) and a window of max_position_embeddings, so full attention."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 64, "rope_theta": 100.0}  # fmt: skip
        return LlamaConfig(rope_parameters=rope, rms_norm_eps=1e-5, **common)
    if kind == "llama_linear":
        rope = {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0}
        return LlamaConfig(rope_parameters=rope, rms_norm_eps=1e-5, **common)
    if kind in ("qwen2_yarn", "qwen3_yarn"):
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 1000.0}
        config_cls = Qwen2Config if kind == "qwen2_yarn" else Qwen3Config
        return config_cls(rope_parameters=rope, rms_norm_eps=1e-6, **common)
    common["hidden_size"] = 64
    return MistralConfig(rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=512, **common)


def make_tiny_model(
    kind: str, out_dir: str | Path, *, tie: bool = False, seed: int = 0, config_overrides: dict | None = None
) -> Path:
    """Build, perturb and save a tiny random model with its tokenizer; returns the directory.
    ``config_overrides`` change the config before the model is built (e.g. other head counts)."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    config = tiny_config(kind, vocab_size=len(tokenizer) + 5, tie=FAMILY_KINDS.get(kind, tie))
    config.update(config_overrides or {})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's routing bias: a checkpoint buffer
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
