"""Which Hugging Face model families rlrun converts to Megatron, and why the others are refused.

Torch-free (``config.json`` is JSON), so the preflight refuses a family in ``rlrun config validate`` with
the message ``train`` would give (rlrun/megatron/hf_config.py, which checks the rest of the architecture).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlrun.megatron.moe import MOE_MODEL_TYPES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
REFUSED_MODEL_TYPES = {
    "gemma3_text": "Megatron's TransformerLayer has no norm after the attention and after the MLP (Gemma's "
    "post_attention_layernorm / post_feedforward_layernorm sandwich), GPTModel has one rotary embedding where "
    "Gemma 3's sliding and full layers use different rope_theta, and the local spec has no (1 + w) RMSNorm, "
    "embedding scaling or per-layer sliding-window attention (SDPACoreAttention is full causal)",
    "gemma3": "it is a vision-language model; its text decoder (gemma3_text) is refused as well",
    "gemma2": "Megatron's TransformerLayer has no norm after the attention and after the MLP (Gemma's sandwich "
    "norms), and the local spec has no attention or final logit soft-capping, (1 + w) RMSNorm or sliding layers",
    "mixtral": "its experts (block_sparse_moe w1/w2/w3) have no entry in rlrun's weight map yet",
}
"""Families asked for but not converted, with the missing piece (``model_type`` errors name it)."""


def unsupported(path: Path, field: str, value: object, constraint: str, reason: str) -> ValueError:
    return ValueError(
        f"{path}: {field} ({value!r}) must {constraint} because {reason}; use a model without it "
        f"or extend rlrun/megatron/hf_config.py"
    )


@dataclass(frozen=True)
class Feature:
    """One thing a ``config.json`` asks of the model, and whether rlrun builds it (``error`` None) or not."""

    name: str
    detail: str
    error: ValueError | None = None

    @property
    def supported(self) -> bool:
        return self.error is None


def family_feature(cfg: dict, path: Path = Path("config.json")) -> Feature:
    """The ``model_type``: supported, or refused with the missing piece (``REFUSED_MODEL_TYPES``)."""
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return Feature("family", str(model_type))
    reason = REFUSED_MODEL_TYPES.get(model_type, "rlrun only converts these decoder families to Megatron")
    error = unsupported(path, "model_type", model_type, f"be one of {SUPPORTED_MODEL_TYPES}", reason)
    return Feature("family", str(model_type), error)
