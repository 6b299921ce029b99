"""Rotary position embedding variants of HF ``config.json`` (``rope_parameters`` / ``rope_scaling``), computed
the way transformers computes them, for Megatron's ``RotaryEmbedding``.

RoPE rotates channel pair ``j`` of each query and key head by ``position * inv_freq[j]``, with
``inv_freq[j] = theta ** (-2j / d)`` (``d`` the rotary dimension). The variants change ``inv_freq`` only,
except YaRN, which also multiplies ``cos`` and ``sin`` by an attention factor ``a``:

* ``default``: as above.
* ``linear`` (position interpolation, https://arxiv.org/abs/2306.15595): ``inv_freq / factor``.
* ``llama3`` (Llama 3.1): with ``L = original_max_position_embeddings`` and wavelength
  ``w = 2 pi / inv_freq``: ``w < L / high_freq_factor`` keeps ``inv_freq``; ``w > L / low_freq_factor``
  takes ``inv_freq / factor``; in between ``(1 - s) inv_freq / factor + s inv_freq`` with
  ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
* ``yarn`` (https://arxiv.org/abs/2309.00071): ``inv_freq`` blends interpolation ``inv_freq / factor`` and
  extrapolation ``inv_freq`` with a linear ramp over the channels between the correction dims of
  ``beta_fast`` and ``beta_slow``; ``a = attention_factor``, else ``0.1 ln(factor) + 1`` (or the ratio of
  the ``mscale`` / ``mscale_all_dim`` versions when both are set).

Why not Megatron's own: its ``rope_scaling=True`` (llama3) hard-codes ``low_freq_factor=1``,
``high_freq_factor=4`` and ``original_max_position_embeddings=8192``
(``RotaryEmbedding._apply_scaling`` receives only ``factor``), and ``GPTModel`` with
``position_embedding_type='yarn'`` drops the attention factor (``rotary_pos_emb, _ = self.rotary_pos_emb(...)``
in ``gpt_model.py``). So the model keeps Megatron's plain ``RotaryEmbedding`` and gets ``inv_freq`` from
here (``apply_to``, every variant, computed on the host as transformers computes it); YaRN's factor scales ``q``
and ``k`` alike (``cos`` and ``sin`` are both multiplied), so it multiplies every attention score by ``a ** 2``,
which is ``softmax_scale = a ** 2 / sqrt(head_dim)``.

Refused: ``dynamic`` (its frequencies depend on the length of the batch being run, and Megatron's are fixed
at build) and ``longrope`` (two frequency tables switched by sequence length); both named in the error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REFUSED_ROPE_TYPES = {
    "dynamic": "its frequencies change with the length of each batch (dynamic NTK), while Megatron's are fixed "
    "when the model is built",
    "longrope": "it switches between two frequency tables by sequence length, which Megatron's rotary cannot",
}


@dataclass(frozen=True)
class Rope:
    """The rotary embedding of an HF decoder (one for all layers)."""

    rope_type: str
    theta: float
    dim: int
    """Rotary channels per head: ``head_dim * partial_rotary_factor``."""
    head_dim: int
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    yarn_attention_factor: float = 1.0
    """YaRN's ``a`` (1 for every other type), resolved from ``attention_factor`` / ``mscale`` / ``factor``."""

    @property
    def rotary_percent(self) -> float:
        return self.dim / self.head_dim

    @property
    def softmax_scale(self) -> float | None:
        """The attention score scale when it is not Megatron's ``1 / sqrt(head_dim)`` (YaRN's ``a ** 2``)."""
        if self.yarn_attention_factor == 1.0:
            return None
        return self.yarn_attention_factor**2 / math.sqrt(self.head_dim)

    def inv_freq(self) -> torch.Tensor:
        """``[dim / 2]`` fp32 inverse frequencies, the same operations as transformers' ``ROPE_INIT_FUNCTIONS``."""
        base = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.int64).to(torch.float) / self.dim))
        if self.rope_type == "default":
            return base
        if self.rope_type == "linear":
            return base / self.factor
        if self.rope_type == "llama3":
            return self._llama3(base)
        return self._yarn()

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_context_len = self.original_max_position_embeddings
        low_freq_wavelen = old_context_len / self.low_freq_factor
        high_freq_wavelen = old_context_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_context_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)

    def _yarn(self) -> torch.Tensor:
        def correction_dim(num_rotations: float) -> float:
            ratio = self.original_max_position_embeddings / (num_rotations * 2 * math.pi)
            return (self.dim * math.log(ratio)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(self.dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = self.theta ** (torch.arange(0, self.dim, 2).to(dtype=torch.float) / self.dim)
        extrapolation_factor = 1 - ramp
        interpolation = 1.0 / (self.factor * pos_freqs)
        return interpolation * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor

    def apply_to(self, rotary) -> None:
        """Give Megatron's ``RotaryEmbedding`` these frequencies (before its first forward: it caches).

        Also for ``default``, whose formula Megatron shares: Megatron evaluates it on the GPU
        (``use_cpu_initialization`` off), while transformers, and so the embedded engine, evaluates it on the host
        when the model loads, and the two ``pow`` implementations may round a frequency one ulp apart. A position
        times a frequency one ulp off is a different angle, so at long positions some bf16 ``cos`` / ``sin``
        round apart and the engine stops being the trainer bit for bit (docs/on_policy.md). Computed here on the
        host, then moved, both sides hold the same bits."""
        rotary.inv_freq = self.inv_freq().to(rotary.inv_freq.device)
        rotary.forward.cache_clear()


def rope_parameters(cfg: dict) -> dict:
    """``config.json``'s rope dict as transformers reads it: ``rope_scaling`` (older files) or
    ``rope_parameters``, with ``rope_theta`` and ``partial_rotary_factor`` from the top level when missing."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if cfg.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def rope_from_config(cfg: dict, head_dim: int, path: Path) -> Rope:
    """The :class:`Rope` of a parsed ``config.json``; a refused type raises ``ValueError`` naming the field."""
    rope = rope_parameters(cfg)
    rope_type = rope["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        reason = REFUSED_ROPE_TYPES.get(rope_type, "rlrun computes only these RoPE variants")
        raise ValueError(
            f"{path}: rope_parameters.rope_type ({rope_type!r}) must be one of {SUPPORTED_ROPE_TYPES} because "
            f"{reason}; use a model without it or extend rlrun/megatron/rope.py"
        )
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    common = dict(rope_type=rope_type, theta=float(rope["rope_theta"]), dim=dim, head_dim=head_dim)
    if rope_type == "default":
        return Rope(**common)
    factor = rope.get("factor")
    if rope_type == "linear":
        return Rope(**common, factor=float(factor))
    # transformers: a top-level original_max_position_embeddings wins, else the rope dict's, else max positions.
    original = cfg.get("original_max_position_embeddings") or rope.get(
        "original_max_position_embeddings", cfg["max_position_embeddings"]
    )
    if rope_type == "llama3":
        return Rope(
            **common,
            factor=float(factor),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(original),
        )
    if factor is None:  # DeepSeek-V3 style: the ratio of the extended to the pretrained length
        factor = cfg["max_position_embeddings"] / original
    return Rope(
        **common,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
        yarn_attention_factor=_yarn_attention_factor(rope, float(factor)),
    )


def _yarn_attention_factor(rope: dict, factor: float) -> float:
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return float(mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"]))
    return mscale(factor)
