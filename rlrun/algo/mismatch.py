"""The train/inference mismatch: importance weights between the trainer's and the engine's log-probs.

The engine samples from pi_rollout, the trainer optimises pi_old's surrogate; numerics (kernels,
precision, batch shapes) make the two differ. Truncated importance sampling (TIS, Yao et al. 2025,
https://fengyao.notion.site/off-policy-rl) multiplies the per-token policy loss by

    w = exp(logp_old - logp_rollout)      at the chosen level (below), then bounded

Levels: ``token`` (one ratio per token), ``sequence`` (the product over the sequence: exp of the
masked sum), ``geometric`` (the geometric mean: exp of the masked mean). Modes:
``clip``  w = clamp(w, clip_low, clip)                         (TIS; clip_low = 0 is plain truncation)
``mask``  w = w if clip_low <= w <= clip else 0                (IcePop / rejection: drop the token or,
                                                                 at sequence levels, the whole sequence)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrun.algo.kl import kl_estimate
from rlrun.algo.segments import sample_sum
from rlrun.config.schema import TISLevel, TISMode

LOG_RATIO_BOUND = 20.0
"""exp(20) ~ 5e8: bounds the raw ratio so a sequence-level product cannot overflow to inf."""


@dataclass
class TISWeights:
    weights: torch.Tensor
    """[B, T] bounded importance weights (no gradient), zero outside the mask."""
    raw: torch.Tensor
    """[B, T] the ratio before bounding."""
    bounded: torch.Tensor
    """[B, T] 1.0 where bounding changed the ratio (clipped or masked)."""


def level_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: TISLevel, sample_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-token log-ratio lifted to ``level`` and broadcast back to every token of its sample
    (``sample_ids`` as in ``rlrun.algo.segments``; None: one sample per row)."""
    if level == "token":
        return log_ratio
    per_sample = sample_sum(log_ratio * mask, sample_ids)
    if level == "geometric":
        per_sample = per_sample / sample_sum(mask, sample_ids).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"TIS level ({level!r}) must be one of token, sequence, geometric")
    return per_sample


def tis_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: TISMode,
    level: TISLevel,
    clip: float,
    clip_low: float,
    sample_ids: torch.Tensor | None = None,
) -> TISWeights:
    """Importance weights pi_old / pi_rollout, bounded by ``mode`` (module docstring)."""
    log_ratio = level_log_ratio((old_logprobs - rollout_logprobs).float().detach(), mask, level, sample_ids)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if mode == "clip":
        weights = raw.clamp(clip_low, clip)
    elif mode == "mask":
        weights = torch.where((raw >= clip_low) & (raw <= clip), raw, torch.zeros_like(raw))
    else:
        raise ValueError(f"TIS mode ({mode!r}) must be clip or mask")
    return TISWeights(weights=weights * mask, raw=raw, bounded=(weights != raw).float())


def mismatch_terms(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token mismatch diagnostics (mask and average them):

    ``logprob_gap``   |logp_train - logp_rollout|
    ``mismatch_k1``   logp_rollout - logp_train        (k1 of KL(rollout || train) at the sampled token)
    ``mismatch_k3``   k3 of KL(rollout || train)       (non-negative, unbiased)
    """
    train, rollout = train_logprobs.detach().float(), rollout_logprobs.float()
    return {
        "logprob_gap": (train - rollout).abs(),
        "mismatch_k1": kl_estimate(rollout, train, "k1"),
        "mismatch_k3": kl_estimate(rollout, train, "k3"),
    }
