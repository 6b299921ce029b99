"""Dynamic sampling filters (``rollout.dynamic_filter``): which whole groups are worth training on.

A filter is ``fn(group: list[Sample]) -> bool`` (True keeps the group), called on rank 0 with the
scored samples of one prompt. ``nonzero_std`` is DAPO's: a group whose rewards are all equal has zero
GRPO advantage everywhere, so it costs a training pass and teaches nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from rlrun.data.sample import Sample
from rlrun.runtime.hooks import HookSpecError, resolve_hook

GroupFilter = Callable[[list[Sample]], bool]
SIGNATURE = "fn(group: list[Sample]) -> bool"


def nonzero_std(group: list[Sample]) -> bool:
    """Keep the group unless every reward in it is the same (exact equality, as the advantage sees it)."""
    return len({s.reward for s in group}) > 1


BUILTIN_FILTERS: dict[str, GroupFilter] = {"nonzero_std": nonzero_std}


def load_filter(spec: str) -> GroupFilter:
    """The filter named by ``rollout.dynamic_filter``: a built-in name or a hook path."""
    if spec in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[spec]
    try:
        return resolve_hook(spec, num_args=1)
    except HookSpecError as err:
        raise HookSpecError(
            f"rollout.dynamic_filter ('{spec}') must be a built-in ({', '.join(BUILTIN_FILTERS)}) "
            f"or name a function with signature {SIGNATURE}, but {err.reason}; "
            "set rollout.dynamic_filter to nonzero_std, module:function or path/to/file.py:function"
        ) from None


def apply_filter(fn: GroupFilter, groups: list[list[Sample]]) -> list[list[Sample]]:
    """The groups ``fn`` keeps, in order; a filter that returns a non-bool is a bug worth stopping for."""
    kept = []
    for group in groups:
        verdict = fn(group)
        if not isinstance(verdict, bool):
            raise TypeError(
                f"rollout.dynamic_filter returned {verdict!r} for group {group[0].group_index}; "
                f"expected a bool ({SIGNATURE})"
            )
        if verdict:
            kept.append(group)
    return kept
