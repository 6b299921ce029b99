"""Multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight: ``deepseek_v3``) as Megatron's ``MLASelfAttention``.

MLA compresses each token into a ``kv_lora_rank`` latent (RMSNorm'd) plus one ``qk_rope_head_dim`` RoPE key shared
by all heads; ``kv_b_proj`` expands the latent into per-head ``[k_nope; v]``. Queries are ``q_b_proj(norm(q_a_proj
(x)))`` (or ``q_proj(x)`` without ``q_lora_rank``), per head ``[q_nope; q_rope]``. Scores use ``[q_nope; q_rope]
. [k_nope; k_rope]`` with scale ``m ** 2 / sqrt(qk_nope + qk_rope)`` (``m`` YaRN's ``mscale_all_dim`` factor).

==================================================  ============================================  =========
Megatron (local spec, layer i)                      HF ``model.layers.i.self_attn.``              how
==================================================  ============================================  =========
self_attention.linear_q_down_proj.weight            q_a_proj.weight                               copy
self_attention.q_layernorm.weight                   q_a_layernorm.weight                          copy
self_attention.linear_q_up_proj.weight              q_b_proj.weight (``q_proj`` without LoRA)     mla_q
self_attention.linear_kv_down_proj.weight           kv_a_proj_with_mqa.weight                     mla_kv
self_attention.kv_layernorm.weight                  kv_a_layernorm.weight                         copy
self_attention.linear_kv_up_proj.weight             kv_b_proj.weight                              copy
self_attention.linear_proj.weight                   o_proj.weight                                 copy
==================================================  ============================================  =========

RoPE layout (``mla_q``, ``mla_kv``). Megatron's MLA always reads RoPE channels as interleaved pairs
(``rope_utils``: ``multi_latent_attention`` de-interleaves to ``[evens; odds]``, then rotates halves), which is
transformers' ``rope_interleave: true`` (DeepSeek-V3's default) exactly, output order included: those weights
copy. With ``rope_interleave: false`` transformers rotates the halves as they are, so the RoPE output rows of
``q_b_proj`` (each head's last ``qk_rope_head_dim``) and of ``kv_a_proj_with_mqa`` (its last
``qk_rope_head_dim``) are interleaved on load (``[h0, h_d/2, h1, h_d/2+1, ...]``, which Megatron's
de-interleave turns back into the halves) and de-interleaved on export, so the round trip is exact.

YaRN: Megatron's ``YarnRotaryEmbedding`` computes transformers' frequencies and multiplies cos/sin by
``mscale(f, mscale) / mscale(f, mscale_all_dim)``; its softmax scale uses ``mscale_all_dim`` as transformers'
does. transformers takes the ratio only when both are set and non-zero (else plain ``mscale(f)``), so rlrun
passes ``mscale = 1, mscale_all_dim = 0`` then (same value) and refuses what Megatron cannot express: an explicit
``attention_factor``, ``mscale_all_dim`` without ``mscale``, ``truncate: false``.

Limits (refused with the reason): TP > 1 (MoE models run at TP 1 anyway, and MLA heads are not padded),
``rms_norm_eps`` other than 1e-6 (transformers builds the q/kv latent norms with 1e-6, Megatron with the
model's epsilon), ``attention_bias``. FlashAttention's varlen kernel needs equal q/k and v head sizes, which MLA
does not have, so ``packed_attention: auto`` runs its packed rows per sample through SDPA (tested on CPU only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

MLA_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class MLAArch:
    """The multi-latent attention of a ``deepseek_v3`` ``config.json``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    rope_type: str
    """Megatron's MLA ``rope_type``: ``rope`` or ``yarn``."""
    rope_theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @classmethod
    def from_dict(cls, cfg: dict, path: Path) -> MLAArch:
        from rlrun.megatron.rope import rope_parameters

        def refuse(field: str, value: object, constraint: str, reason: str) -> ValueError:
            return ValueError(
                f"{path}: {field} ({value!r}) must {constraint} because {reason}; use a model without it "
                "or extend rlrun/megatron/mla.py"
            )

        if float(cfg.get("rms_norm_eps", 1e-6)) != 1e-6:
            raise refuse(
                "rms_norm_eps", cfg["rms_norm_eps"], "be 1e-6", "transformers' q/kv latent norms use 1e-6 and "
                "Megatron's use the model's epsilon",
            )  # fmt: skip
        if cfg.get("attention_bias"):
            raise refuse("attention_bias", True, "be false", "Megatron's MLA projections have no biases")
        rope = rope_parameters(cfg)
        common = dict(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            rope_theta=float(rope["rope_theta"]),
        )
        if rope["rope_type"] == "default":
            return cls(**common, rope_type="rope")
        if rope["rope_type"] != "yarn":
            raise refuse(
                "rope_parameters.rope_type", rope["rope_type"], "be 'default' or 'yarn'",
                "Megatron's MLA implements only these",
            )  # fmt: skip
        if rope.get("attention_factor") is not None or rope.get("factor") is None or not rope.get("truncate", True):
            raise refuse(
                "rope_parameters", rope, "give factor, and no attention_factor or truncate: false",
                "Megatron's MLA YaRN derives its attention factor from factor/mscale and always truncates",
            )  # fmt: skip
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale_all_dim and not mscale:
            raise refuse(
                "rope_parameters.mscale", mscale, "be set when mscale_all_dim is", "Megatron scales cos/sin by "
                "mscale / mscale_all_dim where transformers then uses the plain factor",
            )  # fmt: skip
        if not (mscale and mscale_all_dim):
            mscale, mscale_all_dim = 1.0, 0.0  # transformers' plain 0.1 ln(f) + 1 (see the module docstring)
        original = cfg.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings", cfg["max_position_embeddings"]
        )
        return cls(
            **common,
            rope_type="yarn",
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(original),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(mscale),
            mscale_all_dim=float(mscale_all_dim),
        )

    def config_kwargs(self, tp: int) -> dict:
        """The ``MLATransformerConfig`` arguments."""
        if tp != 1:
            raise ValueError(
                f"parallel.tp ({tp}) must be 1 for multi-latent attention because rlrun does not shard MLA "
                "heads over TP (and its MoE models run at TP 1); use parallel.ep / parallel.etp"
            )
        return dict(
            multi_latent_attention=True,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_type=self.rope_type,
            rotary_base=self.rope_theta,
            rotary_scaling_factor=self.factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            mscale=self.mscale,
            mscale_all_dim=self.mscale_all_dim,
            qk_layernorm=True,  # the q/kv latent norms
        )

    def mappings(self, mc: str, attn: str) -> list[tuple[str, tuple[str, ...], str]]:
        """``(megatron_name, hf_names, kind)`` of one layer's attention (``mc`` / ``attn`` the prefixes)."""
        sa = f"{mc}self_attention."
        if self.q_lora_rank is None:
            rows = [(f"{sa}linear_q_proj.weight", (f"{attn}q_proj.weight",), "mla_q")]
        else:
            rows = [
                (f"{sa}linear_q_down_proj.weight", (f"{attn}q_a_proj.weight",), "copy"),
                (f"{sa}q_layernorm.weight", (f"{attn}q_a_layernorm.weight",), "copy"),
                (f"{sa}linear_q_up_proj.weight", (f"{attn}q_b_proj.weight",), "mla_q"),
            ]
        return rows + [
            (f"{sa}linear_kv_down_proj.weight", (f"{attn}kv_a_proj_with_mqa.weight",), "mla_kv"),
            (f"{sa}kv_layernorm.weight", (f"{attn}kv_a_layernorm.weight",), "copy"),
            (f"{sa}linear_kv_up_proj.weight", (f"{attn}kv_b_proj.weight",), "copy"),
            (f"{sa}linear_proj.weight", (f"{attn}o_proj.weight",), "copy"),
        ]

    def _rope_order(self, to_hf: bool) -> torch.Tensor:
        """Row order within one RoPE block: halves -> interleaved pairs (Megatron's layout), or back (``to_hf``)."""
        d = self.qk_rope_head_dim
        deinterleave = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
        return deinterleave if to_hf else torch.argsort(deinterleave)

    def permute_rope_rows(self, kind: str, weight: torch.Tensor, to_hf: bool = False) -> torch.Tensor:
        """``weight`` with each RoPE block's rows in Megatron's interleaved layout (``to_hf``: back); a copy when
        the checkpoint is interleaved already (``rope_interleave: true``)."""
        if self.rope_interleave:
            return weight
        order = self._rope_order(to_hf)
        if kind == "mla_kv":  # [kv_lora_rank + rope, hidden]: the shared RoPE key is the last block
            return torch.cat([weight[: self.kv_lora_rank], weight[self.kv_lora_rank :][order]])
        per_head = weight.reshape(-1, self.qk_nope_head_dim + self.qk_rope_head_dim, weight.shape[-1])
        nope, rope = per_head.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=1)
        return torch.cat([nope, rope[:, order]], dim=1).reshape(weight.shape)


def patch_mla_without_te() -> None:
    """Let Megatron's MLA build without TransformerEngine; idempotent.

    megatron-core 0.16.1 ``multi_latent_attention`` imports ``megatron.core.extensions.transformer_engine``,
    which succeeds without TE by standing ``MagicMock`` objects in for TE's classes, so the module sets
    ``HAVE_TE = True`` and then ``isinstance(self.linear_proj, TELinear)`` raises ``TypeError``. Without a real
    TE, ``HAVE_TE = False`` is the truth and selects the plain-PyTorch paths.
    """
    from megatron.core.transformer import multi_latent_attention

    from rlrun.megatron.transformer_engine import transformer_engine_attention

    if transformer_engine_attention() is None:
        multi_latent_attention.HAVE_TE = False
