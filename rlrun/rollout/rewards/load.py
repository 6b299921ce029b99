"""Resolve ``rollout.reward`` to a callable: a built-in name, an ``http(s)://`` reward server,
``module:function`` or ``path/to/file.py:function``.

User hooks are imported by ``rlrun.runtime.hooks`` (shared with the algorithm hooks). This runs when the config
is loaded, so a typo in a hook path fails in ``rlrun config validate`` rather than after the model has
loaded. Hooks may be ``async def``; :func:`rlrun.rollout.rewards.score.score_samples` awaits them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rlrun.config.schema import RemoteRewardConfig
from rlrun.data.sample import Sample
from rlrun.runtime.hooks import HookSpecError, resolve_hook
from rlrun.rollout.rewards.builtin import BUILTIN_REWARDS

RewardFn = Callable[[Sample], float | Awaitable[float]]
SIGNATURE = "fn(sample: Sample) -> float"


class RewardSpecError(ValueError):
    """The reward spec cannot be resolved to a function with the expected signature."""


def load_reward_fn(spec: str, remote: RemoteRewardConfig = RemoteRewardConfig()) -> RewardFn:
    """Return the reward function named by ``spec``; raises ``RewardSpecError`` naming the spec.

    A per-group reward (``rollout.reward_per_group``) is resolved the same way: it also takes one
    argument (the group's list of samples).
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if spec.startswith(("http://", "https://")):
        from rlrun.rollout.rewards.remote import RemoteReward  # stdlib HTTP only; imported when used

        return RemoteReward(spec, remote)
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise _error(
            spec,
            f"not a built-in ({', '.join(BUILTIN_REWARDS)}), not an http(s):// URL and not of the form module:function",
        )
    try:
        return resolve_hook(spec, num_args=1, allow_async=True)
    except HookSpecError as err:
        raise _error(spec, err.reason) from None


def _error(spec: str, reason: str) -> RewardSpecError:
    reason = " ".join(reason.split())
    return RewardSpecError(
        f"reward '{spec}': {reason}; expected a built-in name, an http(s):// reward server or "
        f"module:function / path/to/file.py:function with signature {SIGNATURE} "
        "(or async; per group: fn(samples: list[Sample]) -> list[float])"
    )
