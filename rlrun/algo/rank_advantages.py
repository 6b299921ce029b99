"""Per-token advantages on one rank, from the group scores rank 0 broadcast and the role log-probs.

Order (slime's ``compute_advantages_and_returns``):
  1. KL penalty  ``kl_t = kl(logp_old_t, logp_ref_t)`` when ``kl.reward_coef`` > 0
  2. estimator   the configured one (or ``custom_advantage``) -> advantages, returns
  3. OPD         ``A_t -= opd.kl_coef * (logp_old_t - logp_teacher_t)``
  4. whitening   over all DP ranks when ``normalize_advantages``

Statistics that span ranks go through ``dp_sum`` (a sum over the data-parallel group, supplied by the
caller), so this module stays free of torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlrun.algo import specs
from rlrun.algo.advantages import gae, masked_moments, reinforce_returns, token_advantages, token_rewards, whiten
from rlrun.algo.kl import kl_estimate
from rlrun.algo.validate import CUSTOM_ADVANTAGE_SIGNATURE, load_algorithm_hook

if TYPE_CHECKING:
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.data.batch import MicroBatch

DPSum = Callable[[torch.Tensor], torch.Tensor]


def assign_advantages(cfg: AlgorithmConfig, micro_batches: list[MicroBatch], dp_sum: DPSum) -> dict[str, float]:
    """Replace every micro-batch's ``advantages`` (group scores on entry) and set ``returns``.

    Returns step metrics: the token means of the reward KL and the OPD reverse KL when they are on.
    """
    custom = load_algorithm_hook(cfg, "custom_advantage")
    estimator = specs.estimator(cfg)
    stage = TOKEN_STAGES[estimator.entry.token_stage]
    stats = torch.zeros(3)  # sum of reward KL, sum of OPD reverse KL, tokens
    for mb in micro_batches:
        mask = mb.loss_mask
        student = mb.rollout_logprobs if cfg.use_rollout_logprobs else mb.old_logprobs
        kl = None
        if cfg.kl.reward_coef > 0:
            kl = (
                kl_estimate(
                    _required(student, "old_logprobs"), _required(mb.ref_logprobs, "ref_logprobs"), cfg.kl.estimator
                )
                * mask
            )
            stats[0] += kl.sum()
        advantages, returns = (
            _custom(custom, cfg, mb, kl) if custom is not None else stage(estimator.settings, cfg, mb, kl)
        )
        if cfg.opd.kl_coef > 0:
            teacher = _required(mb.teacher_logprobs, "teacher_logprobs")
            reverse_kl = (_required(student, "old_logprobs") - teacher) * mask
            advantages = advantages - cfg.opd.kl_coef * reverse_kl
            stats[1] += reverse_kl.sum()
        stats[2] += mask.sum()
        mb.advantages, mb.returns = advantages, returns
    if cfg.normalize_advantages:
        moments = dp_sum(sum((masked_moments(mb.advantages, mb.loss_mask) for mb in micro_batches), torch.zeros(())))
        for mb in micro_batches:
            mb.advantages = whiten(mb.advantages, mb.loss_mask, moments)
    return _metrics(cfg, dp_sum(stats))


def _per_sample(
    settings: Any, cfg: AlgorithmConfig, mb: MicroBatch, kl: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = token_advantages(mb.advantages, mb.loss_mask, kl, cfg.kl.reward_coef)
    return advantages, advantages


def _returns(
    settings: Any, cfg: AlgorithmConfig, mb: MicroBatch, kl: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    returns = reinforce_returns(mb.advantages, mb.loss_mask, kl, cfg.kl.reward_coef, settings.gamma, mb.sample_ids)
    return returns, returns


def _gae(
    settings: Any, cfg: AlgorithmConfig, mb: MicroBatch, kl: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    mask, samples = mb.loss_mask, mb.sample_ids
    rewards = token_rewards(mb.advantages, mask, kl, cfg.kl.reward_coef, samples)
    return gae(rewards, _required(mb.values, "values (critic)"), mask, settings.gamma, settings.lambd, samples)


TokenStageFn = Callable[
    [Any, "AlgorithmConfig", "MicroBatch", "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]
]
TOKEN_STAGES: dict[str, TokenStageFn] = {"per_sample": _per_sample, "returns": _returns, "gae": _gae}
"""``entries.TokenStage`` -> ``fn(estimator settings, cfg, mb, kl) -> (advantages, returns)``, reading the group
scores in ``mb.advantages``; ``returns`` reads the setting ``gamma``, ``gae`` also ``lambd``."""


def _custom(fn, cfg: AlgorithmConfig, mb: MicroBatch, kl: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    result = fn(cfg, mb, kl if kl is not None else torch.zeros_like(mb.loss_mask))
    shape = tuple(mb.loss_mask.shape)
    ok = (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for t in result)
    )
    if not ok:
        got = (
            type(result).__name__
            if not isinstance(result, (tuple, list))
            else [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in result]
        )
        raise ValueError(
            f"algorithm.custom_advantage ('{cfg.custom_advantage}') must return (advantages, returns), "
            f"two tensors of shape {list(shape)}, because training reads both; it returned {got}. "
            f"Expected signature: {CUSTOM_ADVANTAGE_SIGNATURE}"
        )
    advantages, returns = result
    return advantages.float() * mb.loss_mask, returns.float() * mb.loss_mask


def _required(tensor: torch.Tensor | None, name: str) -> torch.Tensor:
    if tensor is None:
        raise RuntimeError(f"micro-batch {name} missing: the role forward passes must fill it before advantages")
    return tensor


def _metrics(cfg: AlgorithmConfig, stats: torch.Tensor) -> dict[str, float]:
    tokens = max(stats[2].item(), 1.0)
    out = {}
    if cfg.kl.reward_coef > 0:
        out["train/kl_reward"] = stats[0].item() / tokens
    if cfg.opd.kl_coef > 0:
        out["train/opd_reverse_kl"] = stats[1].item() / tokens
    return out
