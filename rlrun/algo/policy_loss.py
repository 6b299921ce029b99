"""PPO clipped policy loss, per token, with its diagnostics."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLossTerms:
    """Per-token tensors (same shape as the inputs); reduce them with the loss mask."""

    loss: torch.Tensor
    clipped: torch.Tensor
    """1.0 where the clipped branch was taken (the gradient through the ratio is cut)."""
    approx_kl: torch.Tensor
    """old_logprobs - logprobs: the k1 estimate of KL(old || new) at the sampled token."""


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> PolicyLossTerms:
    """PPO-clip (arXiv 1707.06347) with asymmetric ranges (clip-higher, DAPO arXiv 2503.14476):

        ratio = exp(logp - logp_old)
        loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    return PolicyLossTerms(
        loss=torch.maximum(unclipped, clipped),
        clipped=(clipped > unclipped).float(),
        approx_kl=-log_ratio,
    )
