"""Hugging Face ``config.json`` -> the Megatron ``TransformerConfig`` and ``GPTModel`` arguments.

Supported families (``model_type``) and what distinguishes them:

* ``llama`` (SmolLM2, Llama 2/3 without rope scaling): no biases, often tied embeddings.
* ``qwen2``: biases on q/k/v (not on o_proj).
* ``qwen3``: RMSNorm on each query and key head (QK-norm) and an explicit ``head_dim``.

All three are pre-norm decoders with RMSNorm, SwiGLU MLPs, grouped-query attention and RoPE; a
config that asks for anything else (rope scaling, sliding windows, MLP biases) is refused with the
``config.json`` field to blame, rather than converted into a model that computes something different.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
VOCAB_PAD_MULTIPLE = 128
"""The embedding is padded to a multiple of ``VOCAB_PAD_MULTIPLE * tp`` rows (Megatron's convention):
each TP rank then holds an equal, aligned vocabulary slice."""


def _unsupported(path: Path, field: str, value: object, constraint: str, reason: str) -> ValueError:
    return ValueError(
        f"{path}: {field} ({value!r}) must {constraint} because {reason}; use a model without it "
        f"or extend rlrun/megatron/hf_config.py"
    )


@dataclass(frozen=True)
class ModelArch:
    """The architecture of one HF decoder, reduced to what the Megatron model needs."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """The HF vocabulary size (rows of ``embed_tokens``), before padding."""
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> ModelArch:
        path = Path(hf_dir) / "config.json"
        return cls.from_dict(json.loads(path.read_text()), path)

    @classmethod
    def from_dict(cls, cfg: dict, path: Path = Path("config.json")) -> ModelArch:
        """Validate a parsed ``config.json`` and keep the fields Megatron needs."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _unsupported(path, "model_type", model_type, f"be one of {SUPPORTED_MODEL_TYPES}",
                               "rlrun only converts these decoder families to Megatron")
        _check_supported_features(cfg, path)
        rope = cfg.get("rope_parameters") or {}
        num_heads = cfg["num_attention_heads"]
        return cls(
            model_type=model_type,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
        )

    def padded_vocab_size(self, tp: int) -> int:
        multiple = VOCAB_PAD_MULTIPLE * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """Refuse a TP size that cannot split the attention heads evenly."""
        for field, value in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads)):
            if value % tp != 0:
                raise ValueError(
                    f"parallel.tp ({tp}) must divide config.json {field} ({value}) because each "
                    f"tensor-parallel rank holds whole heads; set parallel.tp to a divisor of {value}"
                )


def _check_supported_features(cfg: dict, path: Path) -> None:
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if cfg.get("rope_scaling"):
        raise _unsupported(path, "rope_scaling", cfg["rope_scaling"], "be null",
                           "Megatron's RotaryEmbedding here implements plain RoPE only")
    if rope_type != "default":
        raise _unsupported(path, "rope_parameters.rope_type", rope_type, "be 'default'",
                           "Megatron's RotaryEmbedding here implements plain RoPE only")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported(path, "hidden_act", cfg["hidden_act"], "be 'silu'", "the MLP is built as SwiGLU")
    if cfg.get("mlp_bias"):
        raise _unsupported(path, "mlp_bias", True, "be false", "the MLP is built without biases")
    if cfg.get("attention_bias"):
        raise _unsupported(path, "attention_bias", True, "be false",
                           "Megatron's add_qkv_bias cannot express a bias on o_proj")
    if cfg.get("use_sliding_window"):
        raise _unsupported(path, "use_sliding_window", True, "be false", "attention is built as full causal")


def transformer_config(arch: ModelArch, tp: int, pp: int, dtype: str):
    """The Megatron ``TransformerConfig`` of ``arch`` at this TP/PP layout, with dropout off.

    ``calculate_per_token_loss=True`` makes Megatron DDP *sum* gradients over data-parallel ranks
    instead of averaging them; ``train_step`` divides each loss by the global token count itself.
    """
    from megatron.core.transformer import TransformerConfig

    arch.check_tp(tp)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype ({dtype!r}) must be 'float32' or 'bfloat16'; set model.dtype to one of them")
    if arch.num_layers % pp != 0:
        raise ValueError(
            f"parallel.pp ({pp}) must divide config.json num_hidden_layers ({arch.num_layers}) because "
            f"every pipeline stage holds the same number of layers; set parallel.pp to a divisor"
        )
    bf16 = dtype == "bfloat16"
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
