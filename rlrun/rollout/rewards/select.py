"""Multi-task data: each row picks its reward by name from its metadata (slime's per-sample ``rm_type``).

    rollout:
      reward: first_number                                   # rows without metadata["reward_type"]
      rewards: {calc: examples/calculator_tool/agent.py:reward}
      reward_type_key: reward_type                           # metadata["reward_type"] == "calc" -> that one

A group's samples share one prompt, so a per-group reward is picked by the group's prompt.
"""

from __future__ import annotations

from typing import Any

from rlrun.config.schema import RolloutConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards.load import RewardFn, load_reward_fn


class RewardByType:
    """``rewards[prompt.metadata[key]]`` for a row that names a type, ``default`` for one that does not."""

    def __init__(self, default: RewardFn, table: dict[str, RewardFn], key: str) -> None:
        self.default, self.table, self.key = default, table, key

    def fn_for(self, prompt: Prompt) -> RewardFn:
        name = prompt.metadata.get(self.key)
        return self.default if name is None else self.table[name]

    def __call__(self, unit: Sample | list[Sample]) -> Any:
        prompt = unit[0].prompt if isinstance(unit, list) else unit.prompt
        return self.fn_for(prompt)(unit)  # an awaitable is awaited by score_samples

    def check(self, prompts: list[Prompt], where: str) -> None:
        """Raise naming the first row of ``where`` whose type is not in ``rollout.rewards``."""
        for prompt in prompts:
            name = prompt.metadata.get(self.key)
            if name is not None and name not in self.table:
                raise ValueError(
                    f"{where} row {prompt.index}: metadata {self.key} ({name!r}) must name one of rollout.rewards "
                    f"({sorted(self.table)}) because it selects the row's reward; add it to rollout.rewards "
                    "or fix the row"
                )


def load_rewards(r: RolloutConfig) -> RewardFn:
    """``rollout.reward``, or with ``rollout.rewards`` the per-row selection over them (each spec resolved
    now; a bad one raises ``RewardSpecError`` naming it)."""
    default = load_reward_fn(r.reward, r.remote_reward)
    if not r.rewards:
        return default
    table = {name: load_reward_fn(spec, r.remote_reward) for name, spec in r.rewards.items()}
    return RewardByType(default, table, r.reward_type_key)
