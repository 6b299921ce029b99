"""Sampling parameters (SGLang's names and defaults) and one decode step's token sampling.

Log-probs follow SGLang's sampler: ``log_softmax(logits / T)`` of the sampled token, taken before
top-k / top-p / min-p filtering, in fp32. The trainer recomputes exactly this quantity, so filtering
must not leak into it. Temperature 0 means greedy, normalised as SGLang does (``sampling_params.py``:
``temperature < 1e-6`` becomes ``temperature=1, top_k=1``), so its log-probs are those of the
unscaled logits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, sample index) pairs apart
GREEDY_TEMPERATURE_EPS = 1e-6
"""SGLang's ``_SAMPLING_EPS``: a temperature below it means greedy decoding."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One prompt's sampling parameters; defaults are SGLang's."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    """Below 1e-6 it means greedy and is stored as SGLang stores it: temperature 1 with top_k 1."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 keeps the whole vocabulary; 0 (HF's and the rollout config's spelling of that) is read as -1."""
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end a response (included in ``output_ids``), on top of the model's EOS."""
    ignore_eos: bool = False
    """As in SGLang, this disables every token-based stop (EOS and ``stop_token_ids``)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a response ends with the token that completes one of them in its decoded text
    (kept in ``output_ids``; ``finish_reason.matched`` is the string). Not affected by ignore_eos."""
    n: int = 1
    sampling_seed: int | None = None
    """Makes the prompt's samples reproducible: sample j draws from a generator seeded with
    (sampling_seed, prompt tokens, j), independent of the rest of the batch. The prompt tokens are
    mixed in so that prompts sharing one seed do not share random draws; identical prompts with the
    same seed give identical samples (as in SGLang), so ask for a group with ``n``, not duplicates.
    The SGLang backend sends each sample its own seed; SGLang honours it only with
    ``enable_deterministic_inference``."""

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> SamplingParams:
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"sampling_params keys {unknown} must be among {[f.name for f in dataclasses.fields(cls)]} "
                             "because the embedded engine implements only those; drop them")
        values = dict(params)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"] or ())
        if "stop" in values:
            stop = values["stop"]
            values["stop"] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        if values.get("top_k") == 0:
            values["top_k"] = -1  # HF's and the rollout config's "no top-k"; SGLang only accepts -1
        temperature = values.get("temperature", 1.0)
        if temperature is not None and 0 <= temperature < GREEDY_TEMPERATURE_EPS:
            values.update(temperature=1.0, top_k=1)
        sp = cls(**values)
        sp._validate()
        return sp

    def _validate(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1", "a response needs at least one token"),
            ("temperature", self.temperature >= 0, ">= 0", "it divides the logits (0 means greedy)"),
            ("top_p", 0 < self.top_p <= 1, "be in (0, 1]", "it is a probability mass"),
            ("top_k", self.top_k >= -1, ">= -1", "-1 and 0 mean the whole vocabulary"),
            ("stop", all(isinstance(t, str) and t for t in self.stop), "be non-empty strings",
             "an empty stop string would match before the first token"),
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

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    def sample_seed(self, prompt: Sequence[int], sample_index: int) -> int:
        """Seed of the generator of sample ``sample_index`` of ``prompt`` (needs ``sampling_seed``)."""
        assert self.sampling_seed is not None
        digest = hashlib.blake2b(struct.pack(f"<{len(prompt)}q", *prompt), digest_size=8).digest()
        prompt_key = int.from_bytes(digest, "little")
        return (self.sampling_seed + prompt_key + (sample_index + 1) * _GOLDEN) % 2**64


def per_prompt_params(num_prompts: int, sampling_params: Mapping[str, Any] | Sequence[Any]) -> list[SamplingParams]:
    """One validated :class:`SamplingParams` per prompt from one dict (shared) or one dict (or
    already parsed :class:`SamplingParams`) per prompt."""
    if num_prompts < 1:
        raise ValueError("input_ids (empty) must hold at least one prompt because a generate call samples prompts")
    if isinstance(sampling_params, Mapping):
        sampling_params = [sampling_params] * num_prompts
    if len(sampling_params) != num_prompts:
        raise ValueError(f"sampling_params ({len(sampling_params)} dicts) must be one dict or one per prompt "
                         f"({num_prompts}) because each prompt samples with its own; pass one shared dict")
    parsed: dict[int, SamplingParams] = {}  # a shared dict is parsed once
    for sp in sampling_params:
        if id(sp) not in parsed:
            parsed[id(sp)] = sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp)
    return [parsed[id(sp)] for sp in sampling_params]


def row_rids(rids: Sequence[str], params: Sequence[SamplingParams]) -> list[str]:
    """The rid of every sample, prompt-major: the prompt's rid when n == 1, else ``<rid>-<j>``."""
    return [rid if p.n == 1 else f"{rid}-{j}" for rid, p in zip(rids, params) for j in range(p.n)]


def filter_probs(probs: torch.Tensor, rows: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero the tokens that top-k, top-p and min-p exclude, row by row (renormalising is left to
    ``torch.multinomial``, which accepts unnormalised weights). The most likely token always survives."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    device = probs.device
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=probs.dtype, device=device)
    min_p = torch.tensor([r.min_p for r in rows], dtype=probs.dtype, device=device)
    rank = torch.arange(vocab, device=device).expand_as(sorted_probs)
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
    Greedy rows (``top_k == 1``) take the first argmax, as SGLang's and HF's greedy paths do, and
    draw nothing from their generator.
    """
    temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=logits.device)
    logprobs = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    tokens = logprobs.argmax(dim=-1)
    sampled = [b for b, r in enumerate(rows) if not r.greedy]
    if sampled:
        probs = logprobs[sampled].exp()
        sampled_rows = [rows[b] for b in sampled]
        if any(r.needs_filter for r in sampled_rows):
            probs = filter_probs(probs, sampled_rows)
        draws = [torch.multinomial(probs[k], 1, generator=generators[b]) for k, b in enumerate(sampled)]
        tokens[sampled] = torch.cat(draws)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
