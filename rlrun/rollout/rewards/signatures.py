"""Reward functions as the ecosystem writes them, told apart by their parameters (no adapter to write):

* rlrun: ``fn(sample) -> float`` (or per group ``fn(samples) -> list[float]``; plain or ``async def``);
* verl: ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``: called
  per sample with the row's ``data_source`` (metadata), the response text, the label and the row's
  ``extra_info`` (metadata; the whole metadata when the row has none). A dict result trains on
  ``rollout.reward_key`` (verl's own key is ``score``);
* TRL: ``fn(prompts, completions, **kwargs) -> list[float]`` (a batch): called with the prompt texts, the
  completion texts and, as keyword lists, ``completion_ids``, ``label`` and every metadata key (with
  ``data.label_key: null`` every column of the row but the prompt, as TRL passes them). Per sample (a batch
  of one) or, with ``rollout.reward_per_group``, per group.

A function that has a ``solution_str`` or ``ground_truth`` parameter is verl's; one with ``completions``
is TRL's; anything else is rlrun's and must take one argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from rlrun.data.sample import Sample

VERL_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
TRL_SIGNATURE = "fn(prompts, completions, **kwargs) -> list[float]"


def detect(fn: Callable) -> str:
    """``"verl"``, ``"trl"`` or ``"rlrun"``: whose signature ``fn`` has."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "rlrun"  # no introspectable signature: called as fn(sample)
    if names & {"solution_str", "ground_truth"}:
        return "verl"
    if "completions" in names:
        return "trl"
    return "rlrun"


class VerlReward:
    """A verl ``compute_score`` called as an rlrun per-sample reward."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))

    def __call__(self, sample: Sample) -> Any:
        metadata = sample.prompt.metadata
        return self.fn(
            data_source=metadata.get("data_source"),
            solution_str=sample.response_text,
            ground_truth=sample.prompt.label,
            extra_info=metadata.get("extra_info", metadata),
        )


class TrlReward:
    """A TRL batch reward called as an rlrun reward: per sample (a batch of one) or per group (a list)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        parameters = inspect.signature(fn).parameters.values()
        self.takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        self.names = {p.name for p in parameters}

    def __call__(self, unit: Sample | list[Sample]) -> Any:
        batch = unit if isinstance(unit, list) else [unit]
        kwargs = {
            "prompts": [s.prompt.prompt_text for s in batch],
            "completions": [s.response_text for s in batch],
            "completion_ids": [s.response_ids for s in batch],
            "label": [s.prompt.label for s in batch],
        }
        for key in sorted({k for s in batch for k in s.prompt.metadata}):
            kwargs.setdefault(key, [s.prompt.metadata.get(key) for s in batch])
        if not self.takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in self.names}
        values = self.fn(**kwargs)
        if isinstance(unit, list) or inspect.isawaitable(values):
            return values if isinstance(unit, list) else _first(values)
        if not isinstance(values, (list, tuple)) or len(values) != 1:
            raise TypeError(f"TRL reward {self.__qualname__} returned {values!r}; expected a list of 1 reward")
        return values[0]


async def _first(values: Any) -> Any:
    result = await values
    if not isinstance(result, (list, tuple)) or len(result) != 1:
        raise TypeError(f"TRL reward returned {result!r}; expected a list of 1 reward")
    return result[0]


def adapt(fn: Callable) -> Callable:
    """``fn`` callable as ``fn(sample)`` / ``fn(samples)``, whichever of the three signatures it has."""
    kind = detect(fn)
    if kind == "verl":
        return VerlReward(fn)
    if kind == "trl":
        return TrlReward(fn)
    return fn
