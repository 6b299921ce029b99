"""Scoring samples with one reward function, without letting one bad sample stop the run.

Reward functions may be plain or ``async`` (a remote reward model, a sandboxed checker), and may score
one sample or one whole group at a time. All calls of a batch run in one event loop, at most
``concurrency`` awaiting at once; plain functions simply run inline, or, with a time limit, in reward
processes that can be killed (:mod:`.processes`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections import Counter
from typing import Any

from rlrun.data.sample import Sample
from rlrun.rollout.rewards.load import RewardFn
from rlrun.rollout.rewards.processes import RewardRaised, RewardTimeoutError, reward_processes
from rlrun.rollout.rewards.remote import RemoteReward
from rlrun.rollout.rewards.select import RewardByType
from rlrun.runtime.hooks import raised

logger = logging.getLogger(__name__)


def score_samples(
    samples: list[Sample],
    fn: RewardFn,
    group_size: int | None = None,
    concurrency: int = 64,
    timeout_s: float | None = None,
    reward_key: str | None = None,
    processes: int = 4,
) -> int:
    """Set ``sample.reward`` for every sample; returns how many samples' rewards failed.

    A reward may be a dict of named finite numbers: ``reward_key``'s value becomes ``sample.reward`` and
    the dict ``sample.reward_components`` (without ``reward_key`` a dict fails the sample, as below).

    ``group_size`` None calls ``fn(sample) -> float`` per sample; an int calls
    ``fn(group) -> list[float]`` once per consecutive run of ``group_size`` samples (one prompt's
    group). A reward function that raises, or returns something other than finite numbers (of the
    group's length), gives the sample (or the whole group) reward 0.0 and records
    ``sample.reward_error`` ("ExceptionType: message"); every distinct message is logged once per
    batch with its count, and the caller logs the returned count as a metric. With ``timeout_s`` each call
    runs in a reward process (:mod:`.processes`) and one still running after ``timeout_s`` seconds is killed
    and fails its sample (or group) the same way (``rollout.reward_timeout_s``); an ``http(s)://`` reward
    stays in the rank, its call cancelled at the limit. ``processes`` bounds the calls in flight then.
    """
    if group_size is not None and len(samples) % group_size:
        raise ValueError(
            f"{len(samples)} samples do not form whole groups of rollout.samples_per_prompt ({group_size})"
        )
    units = (
        [[s] for s in samples]
        if group_size is None
        else [samples[i : i + group_size] for i in range(0, len(samples), group_size)]
    )
    if units:
        call = _call if timeout_s is None else _limited(timeout_s)
        if timeout_s is not None:
            concurrency = min(concurrency, processes)
        asyncio.run(_score_units(units, fn, call, group_size is not None, concurrency, reward_key))
    errors = Counter(s.reward_error for s in samples if s.reward_error is not None)
    for message, count in errors.items():
        logger.warning("reward failed for %d sample(s): %s", count, message)
    return sum(errors.values())


async def _score_units(
    units: list[list[Sample]], fn: RewardFn, call, per_group: bool, concurrency: int, reward_key: str | None
) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def score(unit: list[Sample]) -> None:
        for sample in unit:
            sample.reward, sample.reward_error, sample.reward_components = 0.0, None, None
        try:
            async with gate:
                result = await call(fn, unit if per_group else unit[0])
            values = _check_group(result, len(unit)) if per_group else [result]
            rewards = [_reward_value(value, reward_key) for value in values]
        except Exception as err:  # noqa: BLE001 - a user hook may raise anything; it is recorded, not hidden
            message = str(err) if isinstance(err, RewardRaised) else raised(err)
            for sample in unit:
                sample.reward_error = message
            return
        for sample, (reward, components) in zip(unit, rewards, strict=False):
            sample.reward, sample.reward_components = reward, components

    await asyncio.gather(*(score(unit) for unit in units))


async def _call(fn: RewardFn, argument: Any) -> Any:
    result = fn(argument)
    return await result if inspect.isawaitable(result) else result


def _limited(timeout_s: float):
    """A call that gives up after ``timeout_s``: in a reward process (killed then), or for an http(s):// reward
    (async I/O in the rank, bounded by its own per-request timeout) cancelled in the rank."""

    async def call(fn: RewardFn, argument: Any) -> Any:
        if isinstance(fn, RewardByType):
            fn = fn.fn_for(argument[0].prompt if isinstance(argument, list) else argument.prompt)
        if isinstance(fn, RemoteReward):
            try:
                return await asyncio.wait_for(_call(fn, argument), timeout_s)
            except asyncio.TimeoutError:
                raise RewardTimeoutError(f"no reward within rollout.reward_timeout_s ({timeout_s:g} s)") from None
        return await asyncio.to_thread(reward_processes().call, fn, argument, timeout_s)

    return call


def is_finite_reward(value: object) -> bool:
    """Whether ``value`` can train as a reward: a finite real number other than a bool. The reward functions,
    the post-process hook and a rollout_fn's samples are all held to it."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _check_number(value: Any) -> float:
    if not is_finite_reward(value):
        raise TypeError(f"reward function returned {value!r}; expected a finite float")
    return float(value)


def _reward_value(value: Any, reward_key: str | None) -> tuple[float, dict[str, float] | None]:
    """(the reward that trains, the dict's named scores or None) of one returned value."""
    if not isinstance(value, dict):
        return _check_number(value), None
    if reward_key is None:
        raise TypeError(f"reward function returned a dict {value!r}; set rollout.reward_key to the key that trains")
    if reward_key not in value:
        raise KeyError(f"reward dict {value!r} has no rollout.reward_key '{reward_key}'")
    components = {str(key): _check_number(v) for key, v in value.items()}
    return components[reward_key], components


def _check_group(values: Any, size: int) -> list[Any]:
    if not isinstance(values, (list, tuple)) or len(values) != size:
        raise TypeError(f"group reward function returned {values!r}; expected a list of {size} rewards")
    return list(values)
