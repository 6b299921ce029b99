"""``rollout.reward_post_process``: reshape the step's rewards once its batch is known (slime's
``--custom-reward-post-process-path``), on rank 0, before advantages::

    def fn(samples: list[Sample]) -> list[float]     # the step's trained samples: whole groups, prompt-major

e.g. a length penalty, or rescaling one data source's rewards. Each sample's ``reward`` (and
``reward_components``) is the scored one when it is called; what it returns replaces ``reward``. Saved
rollout data (``debug.save_rollout_data``) holds the rewards before it, so a replayed run applies it once.
Example: examples/hooks/rewards.py.
"""

from __future__ import annotations

from collections.abc import Callable

from rlrun.data.sample import Sample
from rlrun.rollout.rewards.score import is_finite_reward
from rlrun.runtime.hooks import load_hook

SIGNATURE = "fn(samples: list[Sample]) -> list[float]"
RewardPostProcess = Callable[[list[Sample]], list[float]]


def load_reward_post_process(spec: str) -> RewardPostProcess:
    return load_hook(spec, "rollout.reward_post_process", SIGNATURE, num_args=1)


def post_process_rewards(fn: RewardPostProcess, samples: list[Sample]) -> dict[str, float]:
    """Replace every sample's reward with ``fn``'s; returns ``rollout/reward_before_post_process``."""
    before = sum(s.reward for s in samples) / max(len(samples), 1)
    rewards = fn(samples)
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        raise ValueError(
            f"rollout.reward_post_process returned {type(rewards).__name__} of {_len(rewards)} values; it must "
            f"return a list of {len(samples)} floats (one per sample, in order) because each replaces that "
            "sample's reward; fix the hook"
        )
    for sample, reward in zip(samples, rewards, strict=True):
        if not is_finite_reward(reward):
            raise ValueError(
                f"rollout.reward_post_process returned {reward!r} for prompt {sample.group_index}; it must "
                "return finite floats because they train; fix the hook"
            )
        sample.reward = float(reward)
    return {"rollout/reward_before_post_process": before}


def _len(value: object) -> str:
    return str(len(value)) if hasattr(value, "__len__") else "no"  # type: ignore[arg-type]
