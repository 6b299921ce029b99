"""Moved to :mod:`rlrun.trainer.actor` (``Actor.prepare`` / ``Actor.train``); this name keeps older imports
working, with the pre-trainer ``logprobs_and_advantages`` for callers that hold no ``Actor``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlrun.algo.rank_advantages import assign_advantages
from rlrun.trainer.actor import OffPolicyError, TrainerHooks, check_on_policy, combine_update_metrics, dp_sum

if TYPE_CHECKING:
    from rlrun.config.schema import RunConfig
    from rlrun.data.batch import MicroBatch
    from rlrun.runtime.dist import Parallel
    from rlrun.trainer.critic import Critic
    from rlrun.trainer.roles import ModelRoles

__all__ = ["OffPolicyError", "check_on_policy", "combine_update_metrics", "dp_sum", "logprobs_and_advantages"]


def logprobs_and_advantages(
    cfg: RunConfig,
    roles: ModelRoles,
    parallel: Parallel,
    micro_batches: list[MicroBatch],
    step: int,
    critic: Critic | None = None,
) -> dict[str, float]:
    """``Actor.prepare``'s sequence on bare parts: critic values, role log-probs, advantages, the hook."""
    if critic is not None:
        critic.fill_values(micro_batches)
    roles.fill_logprobs(micro_batches, cfg.rollout.temperature)
    metrics = assign_advantages(cfg.algorithm, micro_batches, lambda t: dp_sum(parallel, t))
    postprocess = TrainerHooks.load(cfg.algorithm).postprocess
    if postprocess is not None:
        postprocess(cfg.algorithm, step, micro_batches)
    return metrics
