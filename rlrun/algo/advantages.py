"""Advantage estimators: group baselines over whole groups (rank 0), then per-token advantages (each rank).

Two stages, because group statistics need every response of a prompt while KL terms need log-probs
that only exist on the rank that trains the sample:

1. ``score_groups`` (rank 0, before the scatter) turns each group's rewards into one scalar score per
   response with the estimator's group baseline (``GROUP_BASELINES``, named by its ``rlrun.algo.estimators``
   entry).
2. ``token_advantages`` / ``reinforce_returns`` / ``gae`` (each rank, after log-probs; picked by
   ``rank_advantages.TOKEN_STAGES``) turn the score, broadcast over the response tokens, plus an optional
   per-token KL penalty into advantages.

All per-token tensors are ``[B, T]`` with a ``mask`` of the same shape (1.0 on response tokens); rows
may have any number of valid tokens (ragged lengths are just masks). A row may pack several samples:
``sample_ids`` (``rlrun.algo.segments``; None: one sample per row) keeps each sample's last token and
its returns to itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlrun.algo import specs
from rlrun.algo.segments import continues, sample_max

if TYPE_CHECKING:
    from rlrun.algo.specs import ChosenEstimator
    from rlrun.config.schema import AlgorithmConfig

WHITEN_EPS = 1e-8


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, arXiv 2402.03300).

    ``rewards`` is ``[num_groups, group_size]``; each response's advantage is

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     if normalize_std
        A_i =  r_i - mean(r_group)                             otherwise (Dr.GRPO, arXiv 2503.20783)

    with the unbiased std (as slime and TRL use). Every token of a response gets its A_i.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline (RLOO, arXiv 2402.14740; verl's ``compute_rloo_outcome_advantage``):

        A_i = r_i - (sum_j r_j - r_i) / (n - 1)     over the n rewards of a group

    ``rewards`` is ``[num_groups, n]``. A group of one keeps its reward: there is no other response to
    compare it with (verl's rule too).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    if n == 1:
        return rewards.clone()
    return rewards - (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)


GROUP_BASELINES: dict[str, Callable[[torch.Tensor, Any], torch.Tensor]] = {
    "normalised": lambda rewards, settings: grpo_advantages(rewards, normalize_std=settings.normalize_std),
    "mean": lambda rewards, _: grpo_advantages(rewards, normalize_std=False),
    "leave_one_out": lambda rewards, _: rloo_advantages(rewards),
    "none": lambda rewards, _: rewards.clone(),
}
"""``entries.GroupBaseline`` -> ``fn(rewards [num_groups, group_size], estimator settings) -> scores`` (same
shape); ``normalised`` reads the setting ``normalize_std``."""


def group_scores(rewards: torch.Tensor, estimator: ChosenEstimator) -> torch.Tensor:
    """One scalar per response, ``[num_groups, group_size]``, as slime's rollout reward post-process:
    the estimator's group baseline applied to each group's rewards."""
    return GROUP_BASELINES[estimator.entry.baseline](rewards, estimator.settings)


@dataclass
class ScoredGroups:
    """Rank 0's view of a step's groups before packing."""

    scores: torch.Tensor
    """``[num_groups, group_size]``: each response's score (``group_scores``)."""
    keep: torch.Tensor
    """Bool ``[num_groups]``: groups that train (tied ones dropped when ``algorithm.skip_tied_groups``)."""


def score_groups(cfg: AlgorithmConfig, rewards: torch.Tensor) -> ScoredGroups:
    """Rank 0's group scoring: the configured estimator's scores and the tied-group filter."""
    scores = group_scores(rewards, specs.estimator(cfg))
    keep = ~tied_groups(rewards) if cfg.skip_tied_groups else torch.ones(rewards.shape[0], dtype=torch.bool)
    return ScoredGroups(scores, keep)


def tied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool ``[num_groups]``: groups whose rewards are all equal (they carry no GRPO signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)


def token_advantages(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """GRPO / GSPO / CISPO / REINFORCE++-baseline: ``A_t = (score - kl_coef * kl_t) * mask_t``.

    ``scores`` is each sample's score broadcast over its tokens. The KL penalty is per token (the
    REINFORCE++-baseline form, arXiv 2501.03262); slime drops it for the GRPO family, here it applies
    to every estimator so that ``kl.reward_coef`` is never silently ignored.
    """
    advantages = scores.float()
    if kl is not None and kl_coef != 0.0:
        advantages = advantages - kl_coef * kl
    return advantages * mask


def last_token_mask(mask: torch.Tensor, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
    """1.0 at the last valid position of each sample with any valid position, 0 elsewhere."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = sample_max(torch.where(mask > 0, positions, torch.full_like(positions, -1)), sample_ids)
    return ((positions == last) & (mask > 0)).to(mask.dtype)


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    kl_coef: float,
    sample_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards of REINFORCE++ and PPO: ``-kl_coef * kl_t`` on every response token plus the
    sample's score on its last response token."""
    rewards = scores.float() * last_token_mask(mask, sample_ids)
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def discounted_returns(rewards: torch.Tensor, gamma: float, sample_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along the last dim, with ``G`` = 0 past the end of the row and of
    each sample (a later sample's rewards never flow into an earlier one's returns)."""
    carry = continues(sample_ids, rewards).to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = rewards[..., t] + gamma * carry[..., t] * running
        returns[..., t] = running
    return returns


def reinforce_returns(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    kl_coef: float,
    gamma: float,
    sample_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ (arXiv 2501.03262): discounted returns of ``token_rewards``; advantage = return
    (whitened over the batch afterwards, which is REINFORCE++'s baseline). Zero outside the mask."""
    rewards = token_rewards(scores, mask, kl, kl_coef, sample_ids)
    return discounted_returns(rewards, gamma, sample_ids) * mask


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lambd: float,
    sample_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (arXiv 1506.02438) over each sample's action tokens (the mask),
    returns ``(advantages, returns)``; with ``t'`` the sample's next action token after ``t``::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lambd * A_{t'}
        R_t     = A_t + V_t

    Masked positions inside a response (a tool's output in a multi-turn sample) are not steps of the
    policy: they are skipped, not discounted, so the token that calls a tool bootstraps from the value of
    the first token after the tool's output (verl's multi-turn GAE does the same). After the sample's last
    action token the state is terminal (``V`` = ``A`` = 0), also at each sample's end in a packed row.
    """
    values, mask = values.float(), mask.float()
    carry = continues(sample_ids, values).to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[..., 0])
    next_advantage = torch.zeros_like(values[..., 0])
    for t in range(values.shape[-1] - 1, -1, -1):
        next_value, next_advantage = next_value * carry[..., t], next_advantage * carry[..., t]
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        advantage = delta + gamma * lambd * next_advantage
        action = mask[..., t] > 0
        advantages[..., t] = torch.where(action, advantage, 0.0)
        next_value = torch.where(action, values[..., t], next_value)
        next_advantage = torch.where(action, advantage, next_advantage)
    return advantages, (advantages + values) * mask


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares, count]`` of the masked entries: add these up across ranks, then whiten."""
    x = x.float()
    return torch.stack([(x * mask).sum(), (x.square() * mask).sum(), mask.sum().float()])


def whiten(x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with mean and unbiased var from ``moments`` (the sum of
    ``masked_moments`` over every rank's data); zero outside the mask."""
    total, total_sq, count = moments.tolist()
    if count <= 0:
        raise ValueError("cannot whiten advantages: no response token in the whole batch")
    mean = total / count
    var = total_sq / count - mean * mean
    if count >= 2:
        var *= count / (count - 1)
    return (x - mean) * torch.rsqrt(torch.tensor(var + WHITEN_EPS)) * mask
