"""The algorithms rlrun knows, as data: one row per advantage estimator and one per policy loss.

An estimator is a rank-0 group baseline (rewards of a group -> one score per response), a per-rank
token stage (scores + KL penalty -> per-token advantages), and the policy loss it implies when
``algorithm.policy_loss`` is unset. The stages' math is picked by ``advantages.GROUP_BASELINES``,
``rank_advantages.TOKEN_STAGES`` and ``objective.POLICY_LOSS_TERMS``; every other module reads
these rows instead of comparing names. A new estimator is one row here (plus a new stage, if it needs
one) and its test.

Also the value sets (``Literal``) of the ``algorithm`` config, defined here once and imported by the
schema. Imports no torch: ``rlrun config validate`` reads this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Estimator = Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo", "rloo"]
PolicyLoss = Literal["ppo_clip", "gspo", "cispo"]
GroupBaseline = Literal["normalised", "mean", "leave_one_out", "none"]
"""normalised: (r - mean) / (std + eps) (``algorithm.normalize_std`` false drops the std); mean: r - mean;
leave_one_out: r_i - mean of the group's other rewards; none: r (the baseline comes later: whitening or
the critic)."""
TokenStage = Literal["per_sample", "returns", "gae"]
"""per_sample: the score on every response token; returns: discounted returns of the score at the last
token; gae: generalised advantage estimation with the critic's values."""
LossType = Literal["policy", "sft", "custom"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
TISMode = Literal["off", "clip", "mask"]
TISLevel = Literal["token", "sequence", "geometric"]
Aggregation = Literal["token", "sample", "sequence"]
RoutingReplayMode = Literal["none", "trainer", "rollout"]


@dataclass(frozen=True)
class EstimatorSpec:
    baseline: GroupBaseline
    """Rank 0, before the scatter: how a group's rewards become one score per response."""
    token_stage: TokenStage
    """Each rank, after the log-probs: how a response's score becomes per-token advantages."""
    policy_loss: PolicyLoss
    """The loss used when ``algorithm.policy_loss`` is unset (the estimator's paper's)."""
    needs_critic: bool = False
    """Reads the critic's values (``critic.config`` required)."""
    needs_whitening: bool = False
    """Batch whitening is its baseline (``algorithm.normalize_advantages`` required)."""


@dataclass(frozen=True)
class PolicyLossSpec:
    reuses_logprobs: bool
    """Whether the training forward's own detached log-probs may stand in for the old policy's (GSPO's
    sequence ratio needs the whole old sequence before training, as in slime)."""


ESTIMATORS: dict[str, EstimatorSpec] = {
    "grpo": EstimatorSpec("normalised", "per_sample", "ppo_clip"),  # arXiv 2402.03300
    "gspo": EstimatorSpec("normalised", "per_sample", "gspo"),  # arXiv 2507.18071
    "cispo": EstimatorSpec("normalised", "per_sample", "cispo"),  # arXiv 2506.13585
    "reinforce_plus_plus": EstimatorSpec("none", "returns", "ppo_clip", needs_whitening=True),  # arXiv 2501.03262
    "reinforce_plus_plus_baseline": EstimatorSpec("mean", "per_sample", "ppo_clip", needs_whitening=True),
    "ppo": EstimatorSpec("none", "gae", "ppo_clip", needs_critic=True),  # arXiv 1707.06347, GAE 1506.02438
    "rloo": EstimatorSpec("leave_one_out", "per_sample", "ppo_clip"),  # arXiv 2402.14740
}
POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "ppo_clip": PolicyLossSpec(reuses_logprobs=True),
    "gspo": PolicyLossSpec(reuses_logprobs=False),
    "cispo": PolicyLossSpec(reuses_logprobs=True),
}
# The config's Literals and the tables must name the same things (a row without a Literal value could
# never be configured; a value without a row would fail mid-run).
assert set(ESTIMATORS) == set(get_args(Estimator)), "ESTIMATORS and Estimator disagree"
assert set(POLICY_LOSSES) == set(get_args(PolicyLoss)), "POLICY_LOSSES and PolicyLoss disagree"
