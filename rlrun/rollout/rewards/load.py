"""Resolve ``rollout.reward`` to a callable: a built-in name, ``module:function`` or ``path/to/file.py:function``.

User hooks are imported by ``rlrun.hooks`` (shared with the algorithm hooks). This runs when the config
is loaded, so a typo in a hook path fails in ``rlrun config validate`` rather than after the model has
loaded.
"""

from __future__ import annotations

from collections.abc import Callable

from rlrun.data.sample import Sample
from rlrun.hooks import HookSpecError, resolve_hook
from rlrun.rollout.rewards.builtin import BUILTIN_REWARDS

RewardFn = Callable[[Sample], float]
SIGNATURE = "fn(sample: Sample) -> float"


class RewardSpecError(ValueError):
    """The reward spec cannot be resolved to a function with the expected signature."""


def load_reward_fn(spec: str) -> RewardFn:
    """Return the reward function named by ``spec``; raises ``RewardSpecError`` naming the spec."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise _error(spec, f"not a built-in ({', '.join(BUILTIN_REWARDS)}) and not of the form module:function")
    try:
        return resolve_hook(spec, num_args=1)
    except HookSpecError as err:
        raise _error(spec, err.reason) from None


def _error(spec: str, reason: str) -> RewardSpecError:
    reason = " ".join(reason.split())
    return RewardSpecError(f"reward '{spec}': {reason}; expected a built-in name or module:function / "
                           f"path/to/file.py:function with signature {SIGNATURE}")
