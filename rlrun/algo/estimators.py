"""The advantage estimators, one entry each (its settings and its stages), and the one table of them.

An estimator is a rank-0 group baseline and a per-rank token stage (``entries.Estimator``), whose math is
``advantages.GROUP_BASELINES`` and ``rank_advantages.TOKEN_STAGES``. A new estimator is one row below (plus a
stage, if it needs a new one) and its test. Imports no torch: ``rlrun config validate`` reads this table.
"""

from __future__ import annotations

from pydantic import Field

from rlrun.algo.entries import Estimator, NoSettings, Settings


class GroupNormalised(Settings):
    normalize_std: bool = True
    """Divide the group-centred reward by the group std (false gives Dr.GRPO, arXiv 2503.20783)."""


class Returns(Settings):
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of the token returns."""


class GAE(Settings):
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of the token rewards."""
    lambd: float = Field(1.0, ge=0, le=1)
    """GAE's lambda: 1 gives the discounted return minus the value, 0 the one-step TD error."""


ESTIMATORS: dict[str, Estimator] = {
    entry.name: entry
    for entry in (
        Estimator("grpo", GroupNormalised, "normalised", "per_sample", "ppo_clip", "GRPO, arXiv 2402.03300"),
        Estimator("gspo", GroupNormalised, "normalised", "per_sample", "gspo", "GSPO, arXiv 2507.18071"),
        Estimator("cispo", GroupNormalised, "normalised", "per_sample", "cispo", "CISPO, arXiv 2506.13585"),
        Estimator(
            "reinforce_plus_plus",
            Returns,
            "none",
            "returns",
            "ppo_clip",
            "REINFORCE++, arXiv 2501.03262",
            needs_whitening=True,
        ),
        Estimator(
            "reinforce_plus_plus_baseline",
            NoSettings,
            "mean",
            "per_sample",
            "ppo_clip",
            "REINFORCE++-baseline, arXiv 2501.03262",
            needs_whitening=True,
        ),
        Estimator(
            "ppo", GAE, "none", "gae", "ppo_clip", "PPO with GAE, arXiv 1707.06347, 1506.02438", needs_critic=True
        ),
        Estimator("rloo", NoSettings, "leave_one_out", "per_sample", "ppo_clip", "RLOO, arXiv 2402.14740"),
    )
}
"""``algorithm.advantage_estimator``'s names -> their entries."""
