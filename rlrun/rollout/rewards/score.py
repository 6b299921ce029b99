"""Scoring a batch of samples with one reward function, without letting one bad sample stop the run."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable

from rlrun.data.sample import Sample
from rlrun.rollout.rewards.load import RewardFn

logger = logging.getLogger(__name__)


def score_samples(samples: Iterable[Sample], fn: RewardFn) -> int:
    """Set ``sample.reward`` for every sample; returns how many rewards failed.

    A reward function that raises, or returns something that is not a finite number, gives that
    sample reward 0.0 and records ``sample.reward_error`` ("ExceptionType: message"); the caller logs
    the returned count, so failures are visible without ending a long run over one odd response.
    """
    failures = 0
    for sample in samples:
        sample.reward, sample.reward_error = 0.0, None
        try:
            reward = fn(sample)
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                raise TypeError(f"reward function returned {reward!r}; expected a finite float")
            sample.reward = float(reward)
        except Exception as err:  # noqa: BLE001 - a user hook may raise anything; it is recorded, not hidden
            sample.reward_error = f"{type(err).__name__}: {err}"
            if failures == 0:
                logger.warning("reward failed for group %d: %s", sample.group_index, sample.reward_error)
            failures += 1
    return failures
