"""Resolve ``rollout.reward`` to a callable: a built-in name, an ``http(s)://`` reward server,
``module:function`` or ``path/to/file.py:function``.

User hooks are imported by ``rlrun.runtime.hooks`` (shared with the algorithm hooks). This runs when the config
is loaded, so a typo in a hook path fails in ``rlrun config validate`` rather than after the model has
loaded. Hooks may be ``async def``; :func:`rlrun.rollout.rewards.score.score_samples` awaits them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from rlrun.config.schema import RemoteRewardConfig
from rlrun.data.sample import Sample
from rlrun.rollout.rewards.builtin import BUILTIN_REWARDS
from rlrun.rollout.rewards.signatures import TRL_SIGNATURE, VERL_SIGNATURE, adapt, detect
from rlrun.runtime.hooks import HookSpecError, resolve_hook

RewardFn = Callable[[Sample], float | Awaitable[float]]
SIGNATURE = "fn(sample: Sample) -> float"


class RewardSpecError(ValueError):
    """The reward spec cannot be resolved to a function with the expected signature."""


def load_reward_fn(spec: str, remote: RemoteRewardConfig = RemoteRewardConfig()) -> RewardFn:
    """Return the reward function named by ``spec``; raises ``RewardSpecError`` naming the spec.

    A per-group reward (``rollout.reward_per_group``) is resolved the same way: it also takes one
    argument (the group's list of samples). A verl ``compute_score`` or a TRL batch reward is recognised by
    its parameters and called through :mod:`.signatures`.
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec.startswith(("http://", "https://")):
        from rlrun.rollout.rewards.remote import RemoteReward  # stdlib HTTP only; imported when used

        try:
            return RemoteReward(spec, remote)
        except ValueError as err:  # a header names an unset environment variable
            raise RewardSpecError(f"reward '{spec}': {err}") from None
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise _error(
            spec,
            f"not a built-in ({', '.join(BUILTIN_REWARDS)}), not an http(s):// URL and not of the form module:function",
        )
    try:
        fn = resolve_hook(spec, num_args=None, allow_async=True)
    except HookSpecError as err:
        raise _error(spec, err.reason) from None
    if detect(fn) == "rlrun":
        _check_one_argument(spec, fn)
    return adapt(fn)


def _check_one_argument(spec: str, fn: RewardFn) -> None:
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise _error(spec, f"it takes {inspect.signature(fn)}") from None
    except ValueError:
        return  # no introspectable signature; the call will tell


def _error(spec: str, reason: str) -> RewardSpecError:
    reason = " ".join(reason.split())
    return RewardSpecError(
        f"reward '{spec}': {reason}; expected a built-in name, an http(s):// reward server or "
        f"module:function / path/to/file.py:function with signature {SIGNATURE} "
        f"(or async; per group: fn(samples: list[Sample]) -> list[float]; verl's {VERL_SIGNATURE}; "
        f"TRL's {TRL_SIGNATURE})"
    )
