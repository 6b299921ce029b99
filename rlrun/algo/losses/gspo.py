"""GSPO (arXiv 2507.18071): the PPO-clip objective on the length-normalised sequence ratio

    log s_i = (1 / |y_i|) * sum_t (logp_t - logp_old_t)      over the response tokens of sample i

broadcast to every token of the sample (``policy_loss.gspo_log_ratio``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlrun.algo.entries import ClipSettings, PolicyInputs, PolicyLoss

if TYPE_CHECKING:
    from rlrun.algo.policy_loss import PolicyLossTerms

Settings = ClipSettings


def terms(settings: Settings, x: PolicyInputs) -> PolicyLossTerms:
    from rlrun.algo.policy_loss import gspo_loss  # torch only when training: config validation reads ENTRY

    return gspo_loss(
        x.logprobs,
        x.old_logprobs,
        x.advantages,
        x.mask,
        settings.eps_clip,
        settings.clip_high,
        settings.eps_clip_c,
        x.sample_ids,
    )


ENTRY = PolicyLoss("gspo", Settings, terms, reuses_logprobs=False, summary="the clipped sequence ratio (GSPO)")
