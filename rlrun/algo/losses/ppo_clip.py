"""PPO-clip (arXiv 1707.06347) on the per-token ratio, with clip-higher and dual-clip:

ratio = exp(logp - logp_old)
loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
loss  = min(loss, -eps_clip_c * A)   where A < 0, with dual-clip
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlrun.algo.entries import ClipSettings, PolicyInputs, PolicyLoss

if TYPE_CHECKING:
    from rlrun.algo.policy_loss import PolicyLossTerms

Settings = ClipSettings


def terms(settings: Settings, x: PolicyInputs) -> PolicyLossTerms:
    from rlrun.algo.policy_loss import ppo_clip_loss  # torch only when training: config validation reads ENTRY

    return ppo_clip_loss(
        x.logprobs, x.old_logprobs, x.advantages, settings.eps_clip, settings.clip_high, settings.eps_clip_c
    )


ENTRY = PolicyLoss("ppo_clip", Settings, terms, reuses_logprobs=True, summary="PPO's clipped token ratio")
