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
    """Makes the prompt's samples reproducible: sample j draws its noise from a key derived from
    (sampling_seed, prompt tokens, j), independent of the rest of the batch. The prompt tokens are
    mixed in so that prompts sharing one seed do not share random draws; identical prompts with the
    same seed give identical samples (as in SGLang), so ask for a group with ``n``, not duplicates.
    The SGLang backend sends each sample its own seed; SGLang honours it only with
    ``enable_deterministic_inference``."""
    session: str | None = None
    """A conversation's id (one sample): the embedded engine with ``session_cache_size`` keeps its K/V after the
    call, and a later call of the session whose prompt extends those tokens prefills only the new ones. The SGLang
    backend sends nothing of it (its radix cache finds shared prefixes by itself)."""

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> SamplingParams:
        unknown = sorted(set(params) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"sampling_params keys {unknown} must be among {[f.name for f in dataclasses.fields(cls)]} "
                "because the embedded engine implements only those; drop them"
            )
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
            (
                "stop",
                all(isinstance(t, str) and t for t in self.stop),
                "be non-empty strings",
                "an empty stop string would match before the first token",
            ),
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
        """Noise key of sample ``sample_index`` of ``prompt`` (needs ``sampling_seed``)."""
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
        raise ValueError(
            f"sampling_params ({len(sampling_params)} dicts) must be one dict or one per prompt "
            f"({num_prompts}) because each prompt samples with its own; pass one shared dict"
        )
    parsed: dict[int, SamplingParams] = {}  # a shared dict is parsed once
    for sp in sampling_params:
        if id(sp) not in parsed:
            parsed[id(sp)] = sp if isinstance(sp, SamplingParams) else SamplingParams.from_dict(sp)
    return [parsed[id(sp)] for sp in sampling_params]


def row_rids(rids: Sequence[str], params: Sequence[SamplingParams]) -> list[str]:
    """The rid of every sample, prompt-major: the prompt's rid when n == 1, else ``<rid>-<j>``."""
    return [rid if p.n == 1 else f"{rid}-{j}" for rid, p in zip(rids, params, strict=False) for j in range(p.n)]


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), split in 16-bit halves so nothing overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(keys: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One uniform draw in [0, 1) per row, a pure function of (the row's 64-bit key, the step): a
    counter-based generator, so a row's draws do not depend on the rest of the batch, need no
    per-row generator state, and the whole decode step can be replayed as one CUDA graph. Elementwise, so
    ``keys[:, None]`` and ``steps[None]`` give a row's draws for every step at once (``DecodeBatch.noise``: the
    hash is ~60 small integer kernels, too many to launch in every decode step)."""
    low, high = keys & _MASK32, (keys >> 32) & _MASK32
    hashed = _mix32(low ^ _mix32(high ^ _mix32(step & _MASK32)))
    return (hashed >> 8).to(torch.float32) / float(2**24)


def row_key(seed: int) -> int:
    """A 64-bit seed as the int64 a noise key tensor holds (two's complement)."""
    seed %= 2**64
    return seed - 2**64 if seed >= 2**63 else seed


@dataclasses.dataclass
class SamplingTensors:
    """The per-row sampling parameters of one generate call as device tensors (rows = samples).

    Fixed for the whole call, so one decode step reads them without a host round trip; ``sample``
    and ``filter`` are the call's static choices (a captured CUDA graph bakes them in).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    """The vocabulary size where top-k is off."""
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    filters: torch.Tensor
    """[B] bool: the row draws at random through top-k, top-p or min-p (its kept set is replayed)."""
    keys: torch.Tensor
    """int64 noise key per row (:func:`uniform_noise`)."""
    sample: bool
    """Some row draws at random (else every row is greedy)."""
    filter: bool
    """Some drawing row uses top-k, top-p or min-p."""
    unfiltered: bool = True
    """Some drawing row uses none of them (draws over the whole vocabulary); False skips that draw."""

    @classmethod
    def of(
        cls, rows: Sequence[SamplingParams], keys: Sequence[int], vocab: int, device: torch.device
    ) -> SamplingTensors:
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor([r.temperature for r in rows], torch.float32),
            top_k=tensor([_replayable_top_k(r, vocab) for r in rows], torch.long),
            top_p=tensor([r.top_p for r in rows], torch.float32),
            min_p=tensor([r.min_p for r in rows], torch.float32),
            greedy=tensor([r.greedy for r in rows], torch.bool),
            filters=tensor([r.needs_filter and not r.greedy for r in rows], torch.bool),
            keys=tensor(list(keys), torch.long),
            sample=any(not r.greedy for r in rows),
            filter=any(r.needs_filter for r in rows if not r.greedy),
            unfiltered=any(not r.needs_filter for r in rows if not r.greedy),
        )

    @classmethod
    def empty(
        cls, num_rows: int, sample: bool, filter: bool, device: torch.device, unfiltered: bool = True
    ) -> SamplingTensors:
        """Buffers for ``num_rows`` greedy rows with the given static choices (filled by :meth:`put`)."""
        greedy = cls.of([SamplingParams(top_k=1)] * num_rows, [0] * num_rows, 1, device)
        return dataclasses.replace(greedy, sample=sample, filter=filter, unfiltered=unfiltered)

    def take(self, rows: torch.Tensor) -> SamplingTensors:
        """The tensors of ``rows`` (copies), same static choices."""
        return dataclasses.replace(self, **{field: getattr(self, field)[rows] for field in _ROW_FIELDS})

    def head(self, rows: int) -> SamplingTensors:
        """The first ``rows`` rows (views: writes through them reach these tensors), same static choices."""
        return dataclasses.replace(self, **{field: getattr(self, field)[:rows] for field in _ROW_FIELDS})

    def put(self, rows: torch.Tensor, other: SamplingTensors) -> None:
        """Overwrite ``rows`` with ``other``'s (one per row) in place; ``other`` may only drop static choices
        these tensors make (a greedy row in a sampling batch), not add one (the captured step bakes them in)."""
        assert (other.sample <= self.sample) and (other.filter <= self.filter) and (other.unfiltered <= self.unfiltered)
        for field in _ROW_FIELDS:
            getattr(self, field)[rows] = getattr(other, field)


_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "greedy", "filters", "keys")

KEPT_SET_WIDTH = 512
"""At most this many tokens in a kept set: a filtering row's top-k is capped here (prime-rl's bound too; top-p
at 0.9-0.95 rarely keeps more), so the set the trainer replays is the whole set the row sampled from."""


def _replayable_top_k(params: SamplingParams, vocab: int) -> int:
    """The row's top-k as a tensor value: the vocabulary size where off, at most :data:`KEPT_SET_WIDTH` where
    the row filters (so its kept set fits the replay buffer)."""
    top_k = params.top_k if 0 < params.top_k < vocab else vocab
    return min(top_k, KEPT_SET_WIDTH) if params.needs_filter and not params.greedy else top_k


def _filter_sorted(
    sorted_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero the entries of descending-sorted probabilities that top-k, top-p and min-p exclude
    (the first one always survives); per-row parameters are [B] tensors."""
    rank = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device).expand_as(sorted_probs)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # ``top_p < 1`` guard: cumsum rounding can push mass_before past 1.0 in the tail.
    drop = (rank >= top_k[:, None]) | ((mass_before > top_p[:, None]) & (top_p[:, None] < 1))
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    return sorted_probs.masked_fill(drop, 0.0)


def filter_probs(probs: torch.Tensor, rows: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero the tokens that top-k, top-p and min-p exclude, row by row (unnormalised). The most
    likely token always survives."""
    t = SamplingTensors.of(rows, [0] * len(rows), probs.shape[-1], probs.device)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    kept = _filter_sorted(sorted_probs, t.top_k, t.top_p.to(probs.dtype), t.min_p.to(probs.dtype))
    return torch.zeros_like(probs).scatter_(-1, order, kept)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row's unnormalised ``weights`` by one uniform ``u``: the first index whose
    cumulative weight exceeds ``u`` times the total (a zero weight is never drawn)."""
    cdf = weights.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return index.clamp_(max=weights.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    t: SamplingTensors,
    step: torch.Tensor,
    kept_out: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [B], their log-probs [B], fp32).

    ``logits`` is [B, V] in any float dtype: the temperature division computes in fp32 (bf16 logits are
    widened exactly inside it, so no fp32 copy of the logits is written first). Row b draws with one uniform
    ``uniform_noise(keys[b], step)`` (``noise``: those draws when the caller has them tabulated) by inverse
    CDF over its (filtered) probabilities, so its samples depend only on its key and the step, not
    on the batch: a row without a filter draws over the whole vocabulary in token order, a filtering row over
    its kept set in probability order, whatever the other rows do. Greedy rows take the first argmax, as
    SGLang's and HF's greedy paths do. No host synchronisation: the step can be captured in a CUDA graph.

    ``kept_out`` ([B, W] int64, written in place; top-p mask replay): each row's kept set, the token ids
    its filter kept (most likely first, -1 after them; all -1 for a row without a filter). Its rows' log-probs
    are then the sampling distribution's, renormalised over that set: ``log p(t) - log sum_{k kept} p(k)``.
    Without ``kept_out`` they are log_softmax(logits / T) before any filter (SGLang's).

    The embedded engine's decode step takes a Triton kernel instead where every row is greedy on CUDA
    (``rlrun.engine.embedded.decode_batch``).
    """
    logprobs = torch.log_softmax(torch.div(logits, t.temperature[:, None]), dim=-1)  # fp32 temperature: fp32
    tokens = logprobs.argmax(dim=-1)
    log_mass = None
    if t.sample:
        probs, u = logprobs.exp(), uniform_noise(t.keys, step) if noise is None else noise
        # Rows without a filter draw over the whole vocabulary, in token order; with none such (every drawing
        # row filters), ``drawn`` would only be read for greedy rows, which take ``tokens`` below.
        drawn = _inverse_cdf(probs, u) if t.unfiltered else tokens
        if t.filter:
            # A filtering row keeps at most KEPT_SET_WIDTH tokens (its top-k is capped there), so the most
            # likely KEPT_SET_WIDTH, sorted, hold its whole kept set: a top-k instead of sorting the vocabulary.
            top, order = probs.topk(min(KEPT_SET_WIDTH, probs.shape[-1]), dim=-1)
            kept = _filter_sorted(top, t.top_k, t.top_p, t.min_p)
            filtered = order.gather(-1, _inverse_cdf(kept, u)[:, None]).squeeze(-1)
            drawn = torch.where(t.filters, filtered, drawn)
            if kept_out is not None:  # the kept set is a prefix of the sorted order (every filter drops a tail)
                width = kept_out.shape[-1]
                replayed = t.filters[:, None] & (kept[:, :width] > 0)
                kept_out.copy_(torch.where(replayed, order[:, :width], -1))
                log_mass = torch.where(t.filters, kept.sum(-1).log(), 0.0)
        tokens = torch.where(t.greedy, tokens, drawn)
    elif kept_out is not None:
        kept_out.fill_(-1)
    token_logprobs = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, token_logprobs if log_mass is None else token_logprobs - log_mass
