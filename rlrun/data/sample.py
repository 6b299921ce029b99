"""The unit of rollout data: one prompt's response, with what the engine and the reward said of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    """One dataset row, tokenized.

    ``index`` is the row's position in the file (stable across shuffles), used to name groups.
    """

    index: int
    prompt_ids: list[int]
    prompt_text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sample:
    """One response to a prompt.

    Invariants: ``len(rollout_logprobs) == len(response_ids)``; samples of one group share
    ``group_index`` and ``prompt_ids`` and travel together (never split across DP ranks' steps).
    """

    group_index: int
    prompt: Prompt
    response_ids: list[int]
    response_text: str
    rollout_logprobs: list[float]
    finish_reason: str
    """"stop" (ended on EOS or a stop token), "length" (hit max_new_tokens) or "abort"."""
    weight_version: str = ""
    reward: float = 0.0
    reward_error: str | None = None
    """The reward function's exception message when it raised (the reward is then 0)."""

    @property
    def total_length(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.response_ids)
