"""Sampling parameters (SGLang's names and defaults) and one decode step's token sampling.

Log-probs follow SGLang's sampler: ``log_softmax(logits / T)`` of the sampled token, taken before
top-k / top-p / min-p filtering, in fp32. The trainer recomputes exactly this quantity, so filtering
must not leak into it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, sample index) pairs apart


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One prompt's sampling parameters; defaults are SGLang's."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0 keep the whole vocabulary (0 is accepted because HF and the rollout config use it)."""
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end a response (included in ``output_ids``), on top of the model's EOS."""
    ignore_eos: bool = False
    """As in SGLang, this disables every token-based stop (EOS and ``stop_token_ids``)."""
    n: int = 1
    sampling_seed: int | None = None
    """Makes the prompt's samples reproducible: sample j draws from a generator seeded with
    (sampling_seed, prompt tokens, j), independent of the rest of the batch. The prompt tokens are
    mixed in so that prompts sharing one seed do not share random draws; identical prompts with the
    same seed give identical samples (as in SGLang), so ask for a group with ``n``, not duplicates."""

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> SamplingParams:
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"sampling_params keys {unknown} must be among {[f.name for f in dataclasses.fields(cls)]} "
                             "because the embedded engine implements only those; drop them")
        values = dict(params)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"] or ())
        sp = cls(**values)
        sp._validate()
        return sp

    def _validate(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1", "a response needs at least one token"),
            ("temperature", self.temperature > 0, "> 0", "greedy decoding is not implemented; use top_k=1"),
            ("top_p", 0 < self.top_p <= 1, "be in (0, 1]", "it is a probability mass"),
            ("top_k", self.top_k >= -1, ">= -1", "-1/0 mean the whole vocabulary"),
            ("min_p", 0 <= self.min_p <= 1, "be in [0, 1]", "it is a fraction of the top probability"),
            ("n", self.n >= 1, ">= 1", "each prompt needs at least one sample"),
        ]
        for key, ok, constraint, reason in checks:
            if not ok:
                constraint = constraint if constraint.startswith("be") else f"be {constraint}"
                raise ValueError(f"sampling_params.{key} ({getattr(self, key)}) must {constraint} because {reason}")

    @property
    def needs_filter(self) -> bool:
        return 0 < self.top_k or self.top_p < 1 or self.min_p > 0

    def sample_seed(self, prompt: Sequence[int], sample_index: int) -> int:
        """Seed of the generator of sample ``sample_index`` of ``prompt`` (needs ``sampling_seed``)."""
        assert self.sampling_seed is not None
        digest = hashlib.blake2b(struct.pack(f"<{len(prompt)}q", *prompt), digest_size=8).digest()
        prompt_key = int.from_bytes(digest, "little")
        return (self.sampling_seed + prompt_key + (sample_index + 1) * _GOLDEN) % 2**64


def filter_probs(probs: torch.Tensor, rows: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero the tokens that top-k, top-p and min-p exclude, row by row (renormalising is left to
    ``torch.multinomial``, which accepts unnormalised weights). The most likely token always survives."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows])
    top_p = torch.tensor([r.top_p for r in rows], dtype=probs.dtype)
    min_p = torch.tensor([r.min_p for r in rows], dtype=probs.dtype)
    rank = torch.arange(vocab).expand_as(sorted_probs)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # ``top_p < 1`` guard: cumsum rounding can push mass_before past 1.0 in the tail.
    drop = (rank >= top_k[:, None]) | ((mass_before > top_p[:, None]) & (top_p[:, None] < 1))
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    kept = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def sample_tokens(logits: torch.Tensor, rows: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [B], their log-probs [B], fp32).

    ``logits`` is [B, V]; row b uses ``rows[b]`` and draws from ``generators[b]`` only, so a row's
    samples do not depend on which other rows share the batch.
    """
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    probs = logprobs.exp()
    if any(r.needs_filter for r in rows):
        probs = filter_probs(probs, rows)
    tokens = torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
