"""Hugging Face ``config.json`` -> the Megatron ``TransformerConfig`` and ``GPTModel`` arguments.

Supported families (``model_type``) and what distinguishes them:

* ``llama`` (SmolLM2, Llama 2, Llama 3.x): no biases, often tied embeddings; Llama 3.1+ scale RoPE
  (``rope_type: llama3``).
* ``mistral``: Llama's weights and layers with an explicit ``head_dim``, and a ``sliding_window`` that is
  accepted only when it is null or at least ``max_position_embeddings`` (then every sequence the model
  can take is shorter than the window, and sliding-window attention is full causal attention).
* ``qwen2``: biases on q/k/v (not on o_proj).
* ``qwen3``: RMSNorm on each query and key head (QK-norm) and an explicit ``head_dim``.
* ``qwen3_moe`` / ``qwen2_moe``: ``qwen3`` / ``qwen2`` attention with mixture-of-experts MLPs
  (``rlrun.megatron.moe``).
* ``glm4_moe`` (GLM-4.5/4.6): q/k/v biases (its ``attention_bias``; o_proj has none), optional QK-norm
  (``use_qk_norm``), RoPE on the first ``partial_rotary_factor`` of each head's channels (half-split
  rotation, the rest passed through: Megatron's ``rotary_percent``), sigmoid-routed MoE with shared experts
  and dense first layers (``rlrun.megatron.moe``).
* ``deepseek_v3`` (DeepSeek-V3/R1, Kimi-K2, Moonlight): multi-latent attention (``rlrun.megatron.mla``) with
  GLM-4.5's router, shared experts and dense first layers.

All are pre-norm decoders with RMSNorm, SwiGLU MLPs, grouped-query attention and RoPE, plain or scaled
(``linear``, ``llama3``, ``yarn``: ``rlrun.megatron.rope``); a config that asks for anything else (dynamic
or long RoPE, effective sliding windows, MLP or o_proj biases) is refused with the ``config.json`` field to
blame, rather than converted into a model that computes something different. ``model_features`` lists
what a config needs, supported or refused, for ``rlrun doctor``.

Head padding. Megatron gives each TP rank whole key/value groups, so ``tp`` must divide the number of
groups ``G`` (and then the number of query heads ``H = G * heads_per_group`` too). When it does not
(SmolLM2: 3 groups at TP=2), the Megatron model gets ``G' = ceil(G / tp) * tp`` groups: the original
ones, then ``G' - G`` inert groups of ``heads_per_group`` query heads each whose q/k/v rows (and biases)
are zero and whose ``linear_proj`` (o_proj) input columns are zero. They change nothing, ever:

* forward: an inert head's values are ``v = x W_v^T = 0``, so its output ``softmax(q k^T) v = 0`` (q = k = 0
  give a uniform softmax, no NaN), and zero o_proj columns add nothing to the layer output either way;
* backward: o_proj's inert columns get ``grad_out^T @ 0 = 0``; the heads' outputs get ``grad_out @ 0 = 0``,
  so ``dv = P^T 0 = 0`` and ``dP = 0 v^T = 0``, hence ``dq = dk = 0`` and every inert q/k/v row and bias
  gets a zero gradient. QK-norm weights (one per head_dim channel, shared by all heads) get nothing from
  inert heads because their normalized inputs ``q = k = 0`` are zero;
* update: Adam(W) maps ``p = m = v = grad = 0`` to ``0`` (weight decay ``lr * wd * p = 0``), and zero
  gradients add nothing to the global grad norm, so clipping is unchanged.

``hf_weights`` adds the padding on load and strips it on export: HF names and shapes never change and
the engine never sees it. The cost is compute: see ``head_padding_note``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rlrun.megatron.families import Feature, family_feature
from rlrun.megatron.families import unsupported as _unsupported
from rlrun.megatron.mla import MLA_MODEL_TYPES, MLAArch
from rlrun.megatron.moe import MOE_MODEL_TYPES, MoEArch, MoEOptions, moe_config_kwargs
from rlrun.megatron.recompute import Recompute
from rlrun.megatron.rope import Rope, rope_from_config

PARTIAL_ROTARY_MODEL_TYPES = ("glm4_moe",)
"""Families whose transformers code rotates the first ``partial_rotary_factor`` of each head and passes the
rest through, as Megatron's ``rotary_percent`` does."""
VOCAB_PAD_MULTIPLE = 128
"""The embedding is padded to a multiple of ``VOCAB_PAD_MULTIPLE * tp`` rows (Megatron's convention):
each TP rank then holds an equal, aligned vocabulary slice."""


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
    rope: Rope | None = None
    """The rotary embedding (scaling variant, rotary channels); None: plain RoPE over ``head_dim``."""
    moe: MoEArch | None = None
    """The mixture-of-experts MLPs; None for a dense model."""
    mla: MLAArch | None = None
    """Multi-latent attention (then ``rope`` is None: MLA builds its own rotary embedding)."""

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> ModelArch:
        path = Path(hf_dir) / "config.json"
        return cls.from_dict(json.loads(path.read_text()), path)

    @classmethod
    def from_dict(cls, cfg: dict, path: Path = Path("config.json")) -> ModelArch:
        """Validate a parsed ``config.json`` and keep the fields Megatron needs."""
        model_type = cfg.get("model_type")
        family = family_feature(cfg, path)
        if family.error is not None:
            raise family.error
        _check_supported_features(cfg, path)
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"{path}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads}) because every key/value head serves the same number of query heads; "
                f"this config.json does not describe a grouped-query attention model"
            )
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        mla = MLAArch.from_dict(cfg, path) if model_type in MLA_MODEL_TYPES else None
        rope = rope_from_config(cfg, head_dim, path) if mla is None else None
        return cls(
            model_type=model_type,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            rope_theta=rope.theta if rope is not None else mla.rope_theta,
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or (model_type == "glm4_moe" and bool(cfg["attention_bias"])),
            qk_norm=model_type in ("qwen3", "qwen3_moe") or (model_type == "glm4_moe" and bool(cfg["use_qk_norm"])),
            rope=rope,
            moe=MoEArch.from_dict(cfg, path, cfg["num_hidden_layers"]) if model_type in MOE_MODEL_TYPES else None,
            mla=mla,
        )

    def padded_vocab_size(self, tp: int) -> int:
        multiple = VOCAB_PAD_MULTIPLE * tp
        return -(-self.vocab_size // multiple) * multiple

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_num_kv_heads(self, tp: int) -> int:
        """Key/value groups of the Megatron model: ``num_kv_heads`` rounded up to a multiple of ``tp``
        (the inert groups of "Head padding" above; none when ``tp`` divides ``num_kv_heads``)."""
        return -(-self.num_kv_heads // tp) * tp

    def padded_num_heads(self, tp: int) -> int:
        """Query heads of the Megatron model: every group, inert ones included, has ``heads_per_group``."""
        return self.padded_num_kv_heads(tp) * self.heads_per_group


def head_padding_note(arch: ModelArch, tp: int) -> str | None:
    """What head padding at ``tp`` adds and costs, for the log; ``None`` when there is no padding.

    The matmul cost is the inert heads' q/k/v rows and o_proj columns over one layer's weights (the
    per-token work of the decoder layers); attention scores and values grow with the head count.
    """
    groups, heads = arch.padded_num_kv_heads(tp), arch.padded_num_heads(tp)
    if groups == arch.num_kv_heads:
        return None

    def layer_weights(num_heads: int, num_groups: int) -> int:
        qkv_and_o = (2 * num_heads + 2 * num_groups) * arch.head_dim * arch.hidden_size
        return qkv_and_o + 3 * arch.hidden_size * arch.ffn_hidden_size

    extra = layer_weights(heads, groups) / layer_weights(arch.num_heads, arch.num_kv_heads) - 1
    return (
        f"parallel.tp ({tp}) does not divide the {arch.num_kv_heads} key/value groups, so each layer gets "
        f"{groups - arch.num_kv_heads} inert zero group(s): {arch.num_heads} -> {heads} query heads, "
        f"{arch.num_kv_heads} -> {groups} key/value heads (exact: they stay zero and are stripped on export); "
        f"cost: +{extra:.1%} decoder-layer matmul work and +{heads / arch.num_heads - 1:.0%} attention-score "
        f"work. A parallel.tp that divides {arch.num_kv_heads} avoids it"
    )


def _check_supported_features(cfg: dict, path: Path) -> None:
    """Raise for the first feature of ``cfg`` that the Megatron model would not compute as HF does."""
    for feature in model_features(cfg, path):
        if feature.error is not None:
            raise feature.error


def model_features(cfg: dict, path: Path = Path("config.json")) -> list[Feature]:
    """Every architectural feature of ``cfg`` that matters to the conversion, each supported or refused
    (the refusal is the ``ValueError`` that loading would raise); ``rlrun doctor`` prints them."""
    from rlrun.megatron.rope import rope_parameters

    features = [_attention_feature(cfg, path), _rope_feature(cfg, path)]
    rope = rope_parameters(cfg)
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial != 1.0 and cfg.get("model_type") in PARTIAL_ROTARY_MODEL_TYPES:
        features.append(Feature("partial rotary", f"RoPE on {partial:.0%} of each head, the rest passed through"))
    elif partial != 1.0:
        reason = (
            f"transformers' {cfg.get('model_type')} rotates whole heads (its default RoPE ignores the "
            "factor and its attention has no pass-through channels)"
        )
        error = _unsupported(path, "partial_rotary_factor", partial, "be 1.0", reason)
        features.append(Feature("partial rotary", f"RoPE on {partial:.0%} of each head", error))
    activation = cfg.get("hidden_act", "silu")
    mlp = "mixture of experts" if cfg.get("model_type") in MOE_MODEL_TYPES else "dense"
    features.append(
        Feature(f"MLP ({mlp})", f"{activation}, gated")
        if activation == "silu"
        else Feature(
            "MLP", activation, _unsupported(path, "hidden_act", activation, "be 'silu'", "the MLP is built as SwiGLU")
        )
    )
    if cfg.get("mlp_bias"):
        features.append(
            Feature("MLP bias", "", _unsupported(path, "mlp_bias", True, "be false", "the MLP is built without biases"))
        )
    if cfg.get("attention_bias") and cfg.get("model_type") != "glm4_moe":  # GLM's attention_bias is q/k/v only
        reason = "Megatron's add_qkv_bias cannot express a bias on o_proj"
        features.append(Feature("o_proj bias", "", _unsupported(path, "attention_bias", True, "be false", reason)))
    features.append(_sliding_window_feature(cfg, path))
    if cfg.get("model_type") in MOE_MODEL_TYPES:
        features.append(_moe_feature(cfg, path))
    tied = bool(cfg.get("tie_word_embeddings", False))
    features.append(Feature("embeddings", "tied to the output layer" if tied else "separate lm_head"))
    return features


def _attention_feature(cfg: dict, path: Path) -> Feature:
    if cfg.get("model_type") in MLA_MODEL_TYPES:
        try:
            mla = MLAArch.from_dict(cfg, path)
        except (ValueError, KeyError) as exc:
            return Feature("attention", "multi-latent", exc if isinstance(exc, ValueError) else ValueError(str(exc)))
        detail = (
            f"multi-latent, {cfg.get('num_attention_heads')} heads, q_lora_rank {mla.q_lora_rank}, kv_lora_rank "
            f"{mla.kv_lora_rank}, RoPE {mla.rope_type}{' interleaved' if mla.rope_interleave else ''}"
        )
        return Feature("attention", detail)
    heads, groups = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    extras = {"qwen2": ", q/k/v bias", "qwen2_moe": ", q/k/v bias", "qwen3": ", QK-norm", "qwen3_moe": ", QK-norm"}
    extra = extras.get(cfg.get("model_type"), "")
    if cfg.get("model_type") == "glm4_moe":
        extra = (", q/k/v bias" if cfg.get("attention_bias") else "") + (", QK-norm" if cfg.get("use_qk_norm") else "")
    detail = f"{heads} query heads, {groups} key/value heads{extra}"
    return Feature("attention", detail)


def _rope_feature(cfg: dict, path: Path) -> Feature:
    from rlrun.megatron.rope import rope_parameters

    rope = rope_parameters(cfg)
    detail = f"{rope['rope_type']}, theta {rope['rope_theta']}"
    if rope.get("factor") is not None:
        detail += f", factor {rope['factor']}"
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(cfg.get("num_attention_heads") or 1, 1)
    try:
        rope_from_config(cfg, head_dim, path)
    except (ValueError, KeyError) as exc:
        error = exc if isinstance(exc, ValueError) else ValueError(f"{path}: rope_parameters lacks {exc}")
        return Feature("RoPE", detail, error)
    return Feature("RoPE", detail)


def _moe_feature(cfg: dict, path: Path) -> Feature:
    try:
        moe = MoEArch.from_dict(cfg, path, cfg["num_hidden_layers"])
    except ValueError as exc:
        return Feature("MoE routing", "", exc)
    detail = f"{moe.num_experts} experts, top-{moe.topk}, {moe.score_function}"
    detail += " + correction bias" if moe.expert_bias else ""
    detail += f", groups {moe.group_topk} of {moe.num_groups}" if moe.num_groups else ""
    detail += f", scaling {moe.scaling_factor}" if moe.scaling_factor not in (None, 1.0) else ""
    detail += ", shared expert" if moe.shared_expert_ffn_hidden_size else ""
    dense = moe.moe_layers.count(False)
    return Feature("MoE routing", detail + (f", {dense} dense layer(s)" if dense else ""))


def _sliding_window_feature(cfg: dict, path: Path) -> Feature:
    """Mistral applies ``sliding_window`` whenever it is set; Qwen2/Qwen3 only with ``use_sliding_window``.
    A window of at least ``max_position_embeddings`` tokens never cuts a sequence the model can take."""
    window = cfg.get("sliding_window")
    applied = cfg.get("use_sliding_window", False) if cfg.get("model_type") != "mistral" else window is not None
    if not applied:
        return Feature("attention span", "full causal")
    max_positions = cfg["max_position_embeddings"]
    if window is not None and window >= max_positions:
        return Feature("attention span", f"sliding window {window} >= {max_positions} positions: full causal")
    field = "sliding_window" if cfg.get("model_type") == "mistral" else "use_sliding_window"
    value = window if field == "sliding_window" else True
    error = _unsupported(
        path,
        field,
        value,
        f"be null or a window of at least max_position_embeddings ({max_positions})"
        if field == "sliding_window"
        else "be false (or sliding_window at least max_position_embeddings)",
        f"attention is built as full causal, and a window of {window} tokens would hide earlier tokens "
        "from longer sequences",
    )
    return Feature("attention span", f"sliding window {window}", error)


def transformer_config(
    arch: ModelArch,
    tp: int,
    pp: int,
    dtype: str,
    ep: int = 1,
    etp: int = 1,
    moe_options: MoEOptions | None = None,
    recompute: Recompute | None = None,
    cp: int = 1,
):
    """The Megatron ``TransformerConfig`` of ``arch`` at this TP/PP (and, for MoE, EP/ETP) layout, with
    dropout off and ``recompute``'s activation recompute (rlrun/megatron/recompute.py; default none).

    ``calculate_per_token_loss=True`` makes Megatron DDP *sum* gradients over data-parallel ranks
    instead of averaging them; ``train_step`` divides each loss by the global token count itself.
    """
    from megatron.core.transformer import TransformerConfig

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype ({dtype!r}) must be 'float32' or 'bfloat16'; set model.dtype to one of them")
    if arch.num_layers % pp != 0:
        raise ValueError(
            f"parallel.pp ({pp}) must divide config.json num_hidden_layers ({arch.num_layers}) because "
            f"every pipeline stage holds the same number of layers; set parallel.pp to a divisor"
        )
    bf16 = dtype == "bfloat16"
    moe = {} if arch.moe is None else moe_config_kwargs(arch.moe, moe_options or MoEOptions(), tp, ep, etp)
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.padded_num_heads(tp),
        num_query_groups=arch.padded_num_kv_heads(tp),
        kv_channels=arch.head_dim,  # explicit: hidden_size / num_attention_heads is wrong once heads are padded
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        softmax_scale=arch.rope.softmax_scale if arch.rope is not None else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
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
        **moe,
        **(recompute or Recompute()).config_kwargs(arch.num_layers // pp),
    )
    if arch.mla is None:
        return TransformerConfig(**kwargs)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**{**kwargs, **arch.mla.config_kwargs(tp)})
