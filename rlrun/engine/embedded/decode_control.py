"""Abort flags and the pause gate that a running decode loop checks once per step.

The embedded engine decodes on its own thread while the worker's event loop keeps answering
``abort``, ``pause_generation`` and ``continue_generation``. Those calls only flip state here; the
decode loop reads it at the next step boundary (:meth:`DecodeControl.checkpoint`, and
:attr:`RequestHandle.aborted`), so a step is never interrupted halfway and weights are only swapped
while every running loop is parked (:meth:`DecodeControl.all_parked`).

Abort follows SGLang: it applies to requests in flight (registered) only, matches rids by prefix,
and an empty rid without ``abort_all`` does nothing (SGLang ignores it with a warning).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from rlrun.engine.types import GenResult


class RequestHandle:
    """One generate call's rows (samples), each with its rid and an abort flag."""

    def __init__(self, row_rids: Sequence[str]) -> None:
        self.row_rids = list(row_rids)
        self.aborted = [False] * len(self.row_rids)
        """Set from the control thread, read by the decode thread (a list write is atomic under the GIL)."""


class DecodeControl:
    """Registry of in-flight requests plus the pause gate; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._requests: dict[int, RequestHandle] = {}
        self._keys = itertools.count()
        self._paused = False
        self._num_running = 0
        self._num_parked = 0

    # ---- requests and abort -----------------------------------------------------------------------

    @contextmanager
    def registered(self, row_rids: Sequence[str]) -> Iterator[RequestHandle]:
        """Make a request abortable from now until it returns (queued requests included)."""
        handle, key = RequestHandle(row_rids), next(self._keys)
        with self._cond:
            self._requests[key] = handle
        try:
            yield handle
        finally:
            with self._cond:
                del self._requests[key]

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Flag the in-flight rows whose rid starts with ``rid`` (or all); returns how many."""
        if not rid and not abort_all:
            return 0
        num_flagged = 0
        with self._cond:
            for handle in self._requests.values():
                for row, row_rid in enumerate(handle.row_rids):
                    if abort_all or row_rid.startswith(rid):
                        num_flagged += not handle.aborted[row]
                        handle.aborted[row] = True
            self._cond.notify_all()  # a parked loop must wake to finish its aborted rows
        return num_flagged

    @property
    def num_requests(self) -> int:
        with self._cond:
            return len(self._requests)

    # ---- pause gate -------------------------------------------------------------------------------

    def pause(self) -> None:
        """Park every running decode loop at its next step boundary (SGLang's in_place/retract)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a decode loop as running while it is inside this block."""
        with self._cond:
            self._num_running += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_running -= 1
                self._cond.notify_all()

    def checkpoint(self, handle: RequestHandle) -> None:
        """Called by a decode loop before each step: wait while paused, unless every row of
        ``handle`` is aborted (an aborted request must still return, as in SGLang)."""
        with self._cond:
            if not self._paused:
                return
            self._num_parked += 1
            self._cond.notify_all()
            try:
                self._cond.wait_for(lambda: not self._paused or all(handle.aborted))
            finally:
                self._num_parked -= 1

    def all_parked(self) -> bool:
        """True when no decode loop can touch the weights: none runs, or all wait at a checkpoint."""
        with self._cond:
            return self._num_running == self._num_parked


class EarlyDelivery:
    """Parts of one decode batch (the rows of each merged generate call) and where their results go."""

    def __init__(self, parts: Sequence[Sequence[int]], callback: Callable[[int, list[GenResult]], None]) -> None:
        self.parts = [list(p) for p in parts]
        self.callback = callback
        """``callback(part, results)``, called on the decode thread once per part delivered early."""
        self.delivered = [False] * len(self.parts)

    def deliver_done(self, done: Mapping[int, GenResult]) -> None:
        """Hand over each part whose rows all have results in ``done`` (by row), once."""
        for k, rows in enumerate(self.parts):
            if not self.delivered[k] and all(b in done for b in rows):
                self.delivered[k] = True
                self.callback(k, [done[b] for b in rows])
