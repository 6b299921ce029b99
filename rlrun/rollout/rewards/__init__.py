"""Reward functions: built-ins, user hooks loaded by path, and scoring a batch of samples.

A reward function has the signature ``fn(sample: Sample) -> float`` (or ``async def``, or per group
``fn(samples: list[Sample]) -> list[float]``); it sees the response text, ``finish_reason``, the
prompt (with its ``label`` and row ``metadata``) and returns a scalar. ``rollout.reward`` may also be
the URL of an HTTP reward server (:mod:`.remote`).
"""

from rlrun.rollout.rewards.builtin import BUILTIN_REWARDS, exact_match, first_number
from rlrun.rollout.rewards.load import RewardFn, RewardSpecError, load_reward_fn
from rlrun.rollout.rewards.score import score_samples

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardSpecError",
    "exact_match",
    "first_number",
    "load_reward_fn",
    "score_samples",
]
