"""Off-policy sequence masking (OPSM, DeepSeek-V3.2 arXiv 2512.02556; slime's ``--use-opsm``): PPO-clip,
with every token of a sequence dropped from the loss when its advantage is negative and the sequence has
drifted too far from the policy that sampled it:

    kl_i  = (1 / |y_i|) * sum_t (logp_rollout_t - logp_t)      (sample i's response tokens; no gradient)
    M_t   = 0  if A_t < 0 and kl_i > delta,  else 1
    loss  = M_t * ppo_clip_t

``logp_rollout`` is the engine's (the behaviour policy), so ``kl_i`` covers both the train/inference
mismatch and the staleness of the weights that sampled. Positive-advantage sequences always train:
learning from a success of a stale policy is safe, pushing down a stale failure is what destabilises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from rlrun.algo.entries import ClipSettings, PolicyInputs, PolicyLoss

if TYPE_CHECKING:
    import torch

    from rlrun.algo.policy_loss import PolicyLossTerms


class Settings(ClipSettings):
    delta: float = Field(1e-4, ge=0)
    """The sequence KL (per-token mean of log(pi_rollout / pi)) above which a negative-advantage sequence is
    masked (slime's ``--opsm-delta``)."""


def sequence_kl(x: PolicyInputs) -> torch.Tensor:
    """``kl_i`` of each token's sample (module docstring), detached: the mask carries no gradient."""
    from rlrun.algo.segments import sample_sum  # torch only when training: config validation reads ENTRY

    drift = (x.rollout_logprobs - x.logprobs.detach()) * x.mask
    return sample_sum(drift, x.sample_ids) / sample_sum(x.mask, x.sample_ids).clamp(min=1)


def terms(settings: Settings, x: PolicyInputs) -> PolicyLossTerms:
    from rlrun.algo.policy_loss import ppo_clip_loss

    clip = ppo_clip_loss(
        x.logprobs, x.old_logprobs, x.advantages, settings.eps_clip, settings.clip_high, settings.eps_clip_c
    )
    masked = ((x.advantages < 0) & (sequence_kl(x) > settings.delta)).to(clip.loss.dtype)
    clip.loss = clip.loss * (1 - masked)
    clip.extra["opsm_masked"] = masked
    return clip


ENTRY = PolicyLoss(
    "opsm", Settings, terms, reuses_logprobs=True, summary="PPO-clip without stale negative sequences (OPSM)"
)
