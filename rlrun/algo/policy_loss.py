"""Per-token policy-gradient loss terms: PPO-clip (with clip-higher and dual-clip), GSPO, CISPO, SFT.

Every function returns per-token tensors of the input shape; masking and aggregation happen in
``rlrun.algo.aggregate``. ``log_ratio`` is ``logp - logp_old`` (the importance ratio's log).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlrun.algo.segments import sample_sum


@dataclass
class PolicyLossTerms:
    """Per-token tensors (same shape as the inputs); reduce them with the loss mask."""

    loss: torch.Tensor
    clipped: torch.Tensor
    """1.0 where the ratio was clipped (PPO: the gradient through the ratio is cut)."""
    approx_kl: torch.Tensor
    """old_logprobs - logprobs (GSPO: its sequence mean): the k1 estimate of KL(old || new)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token diagnostics of this loss only, logged as masked sums under their names (``train/<name>``)."""


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO-clip (arXiv 1707.06347) with asymmetric ranges (clip-higher, DAPO arXiv 2503.14476):

    ratio = exp(log_ratio)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    loss  = min(loss, -eps_clip_c * A)   where A < 0, with dual-clip (arXiv 1912.09729), eps_clip_c > 1
    """
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(
                f"eps_clip_c ({eps_clip_c}) must be > 1 because dual-clip bounds the loss of "
                f"negative advantages at c * |A| above the clipped objective; set it to e.g. 3"
            )
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return PolicyLossTerms(loss=loss, clipped=(clipped > unclipped).float(), approx_kl=-log_ratio)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """Token-level PPO-clip: ``clipped_surrogate`` of the per-token ratio."""
    return clipped_surrogate(logprobs - old_logprobs, advantages, eps_clip, eps_clip_high, eps_clip_c)


def gspo_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, sample_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """GSPO's sequence-level log-ratio (arXiv 2507.18071), broadcast to every token of its sample:

        log s_i = (1 / |y_i|) * sum_t mask_t * (logp_t - logp_old_t)

    i.e. the log of the length-normalised sequence likelihood ratio, per sample (``sample_ids`` as in
    ``rlrun.algo.segments``; None: one sample per row). Samples without valid tokens get 0. The
    gradient flows to every token of the sequence through the mean.
    """
    counts = sample_sum(mask, sample_ids).clamp(min=1)
    return sample_sum((logprobs - old_logprobs) * mask, sample_ids) / counts


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
    sample_ids: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """GSPO: the PPO-clip objective on the sequence-level ratio ``exp(gspo_log_ratio)``."""
    return clipped_surrogate(
        gspo_log_ratio(logprobs, old_logprobs, mask, sample_ids), advantages, eps_clip, eps_clip_high, eps_clip_c
    )


def cispo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float
) -> PolicyLossTerms:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): the clipped ratio is a stop-gradient weight,

        loss = -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp

    so clipped tokens still get gradient through ``logp``. Canonical CISPO has no lower bound
    (``eps_clip >= 1``).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return PolicyLossTerms(
        loss=-weight.detach() * advantages * logprobs, clipped=(weight != ratio).float(), approx_kl=-log_ratio
    )


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning: the negative log-likelihood of each target token."""
    return -logprobs
