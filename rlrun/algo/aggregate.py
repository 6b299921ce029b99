"""How per-token loss terms become one scalar: token mean, sample mean, or Dr.GRPO's sequence sum.

With ``m`` the loss mask, ``n_i`` sample i's loss tokens (a sample, not a row: packed rows hold several,
see ``rlrun.algo.segments``), ``N_tok`` / ``N_samp`` the loss tokens /
samples of the whole step over all DP ranks and ``L`` the maximum response length:

    token      sum_{i,t} m x / N_tok                           every token weighs the same
    sample     (1 / N_samp) sum_i (sum_t m x) / n_i            every sample weighs the same (slime's default)
    sequence   (1 / N_samp) sum_i (sum_t m x) / L              Dr.GRPO (arXiv 2503.20783): no length bias

The Megatron train step divides every micro-batch's loss by ``N_tok`` (so gradients do not depend on the
DP / micro-batch layout); ``Aggregator`` therefore returns the *weighted sum* ``sum m w x`` whose
division by ``N_tok`` gives the formulas above, i.e. ``w = 1``, ``N_tok / (n_i N_samp)`` and
``N_tok / (L N_samp)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrun.algo.segments import sample_sum
from rlrun.config.schema import Aggregation


@dataclass(frozen=True)
class StepCounts:
    """Counts over the whole step (all DP ranks), fixed before the first micro-batch trains."""

    num_tokens: int
    """Loss-masked tokens."""
    num_samples: int
    """Samples with at least one loss token."""
    max_response_len: int
    """``L`` of the ``sequence`` aggregation (the configured maximum response length)."""


class Aggregator:
    """``aggregator(x)`` is the weighted sum of the per-token tensor ``x`` over one micro-batch;
    ``aggregator.token_sum(x)`` the plain masked sum (for token-mean metrics). ``sample_ids`` as in
    ``rlrun.algo.segments`` (None: one sample per row), kept where they are: the loss passes the micro-batch's host
    ids, which the segment functions count on the host and copy to the device without a host wait."""

    def __init__(
        self, mask: torch.Tensor, mode: Aggregation, counts: StepCounts, sample_ids: torch.Tensor | None = None
    ) -> None:
        self.mask = mask
        self.sample_ids = sample_ids
        self.weights = mask * _sample_scale(mask, mode, counts, sample_ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weights).sum()

    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.mask).sum()


def _sample_scale(
    mask: torch.Tensor, mode: Aggregation, counts: StepCounts, sample_ids: torch.Tensor | None
) -> torch.Tensor:
    if mode == "token":
        return torch.ones_like(mask[..., :1])
    if counts.num_samples <= 0:
        raise ValueError("num_samples must be positive to average over samples; the step has no loss token")
    if mode == "sample":
        per_sample = sample_sum(mask, sample_ids).clamp(min=1)
        return counts.num_tokens / (per_sample * counts.num_samples)
    if mode == "sequence":
        return torch.full_like(mask[..., :1], counts.num_tokens / (counts.max_response_len * counts.num_samples))
    raise ValueError(f"loss aggregation ({mode!r}) must be one of token, sample, sequence")
