"""The engine contract's state rules, checked by the worker before it touches any backend.

SGLang kills itself on the first three mistakes below (an assertion or a ``set.remove`` KeyError in
its scheduler), so the worker refuses them up front and every backend behaves the same:

* ``release_memory_occupation`` while a request is in flight is an error;
* resuming a tag that is not released is an error (and so is releasing one twice);
* ``generate`` while any tag is released (or generation is paused) is an error;
* weight updates outside a ``begin_weight_update``/``end_weight_update`` session, a second
  ``begin`` and an ``end`` without a session return ``success=False`` with SGLang 0.5.23's messages;
* a weight update while the ``weights`` tag is released returns ``success=False`` (on GPU it would
  write into freed memory; the loop resumes ``["weights"]`` before syncing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from rlrun.engine.types import MEMORY_TAGS, EngineStatus, OpResult

# Verbatim from sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py.
NOT_IN_SESSION = "{method} must run between begin_weight_update() and end_weight_update()"
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
SUCCESS = "Success"


def _normalize_tags(tags: list[str] | None) -> list[str]:
    """``None`` (or empty, as SGLang treats it) means every tag."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(
            f"tags ({unknown}) must be among {list(MEMORY_TAGS)} because those are SGLang's memory "
            "tags; pass a subset of them or None for all"
        )
    return list(dict.fromkeys(tags))


@dataclasses.dataclass
class EngineLifecycle:
    """Released tags, the update session, pause and in-flight requests of one engine."""

    released_tags: set[str] = dataclasses.field(default_factory=set)
    in_update_session: bool = False
    paused: bool = False
    num_inflight: int = 0

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Admit one generate request (or refuse it) and count it as in flight while it runs."""
        if self.released_tags:
            raise RuntimeError(
                f"generate must not run while memory tags {sorted(self.released_tags)} are released because the "
                "engine has no KV cache or weights then; call resume_memory_occupation() first"
            )
        if self.paused:
            raise RuntimeError("generate must not run while generation is paused; call continue_generation() first")
        self.num_inflight += 1
        try:
            yield
        finally:
            self.num_inflight -= 1

    def release(self, tags: list[str] | None) -> list[str]:
        """Record a release; returns the tags it covers."""
        tags = _normalize_tags(tags)
        if self.num_inflight:
            raise RuntimeError(
                f"release_memory_occupation must not run with {self.num_inflight} request(s) in flight because "
                "SGLang asserts an idle scheduler and dies otherwise; call pause_generation('abort') first"
            )
        already = sorted(set(tags) & self.released_tags)
        if already:
            raise RuntimeError(
                f"release_memory_occupation of tags {already} must not repeat because they are "
                "already released; resume them first or release only the others"
            )
        self.released_tags.update(tags)
        return tags

    def check_resume(self, tags: list[str] | None) -> list[str]:
        """The tags a resume covers, or an error if any is not released. The worker records the
        resume only once the backend has finished it, so no generate starts on half-restored memory."""
        tags = _normalize_tags(tags)
        not_released = sorted(set(tags) - self.released_tags)
        if not_released:
            raise RuntimeError(
                f"resume_memory_occupation of tags {not_released} must follow their release because SGLang raises "
                f"KeyError and dies otherwise; released now: {sorted(self.released_tags)}"
            )
        return tags

    def resume(self, tags: list[str] | None) -> list[str]:
        """Check and record a resume; returns the tags it covers."""
        tags = self.check_resume(tags)
        self.released_tags.difference_update(tags)
        return tags

    def begin_update(self) -> OpResult:
        if self.in_update_session:
            return {"success": False, "message": SESSION_ALREADY_OPEN}
        self.in_update_session = True
        return {"success": True, "message": SUCCESS}

    def check_update(self, method: str) -> OpResult | None:
        """None if a weight update may run now, else the failed result to return."""
        if not self.in_update_session:
            return {"success": False, "message": NOT_IN_SESSION.format(method=method)}
        if "weights" in self.released_tags:
            return {
                "success": False,
                "message": f"{method} must not run while the weights tag is released because "
                "it would write into freed memory; call resume_memory_occupation(['weights']) first",
            }
        return None

    def end_update(self) -> OpResult:
        if not self.in_update_session:
            return {"success": False, "message": NO_SESSION_OPEN}
        self.in_update_session = False
        return {"success": True, "message": SUCCESS}

    def check_flush(self) -> OpResult | None:
        """None if the cache may be flushed now (SGLang refuses while requests run or wait)."""
        if self.num_inflight:
            return {
                "success": False,
                "message": f"cannot flush the cache with {self.num_inflight} request(s) in flight",
            }
        return None

    def status(self, weight_version: str) -> EngineStatus:
        return {
            "state": "paused" if self.paused else "ready",
            "released_tags": sorted(self.released_tags),
            "in_update_session": self.in_update_session,
            "num_inflight": self.num_inflight,
            "weight_version": weight_version,
        }
