"""End this process when a block of user code runs past its time limit: a hung hook cannot be interrupted.

Python cannot stop a function that sleeps, spins or waits on a socket without a timeout, and a rank
stuck in one leaves its peers waiting in their next collective (the watchdog sees its heartbeats, so it
is not dead). :func:`hard_deadline` prints one line naming what ran too long and the line it is stuck
on, then exits the process (``EXIT_DEADLINE``); the other ranks' watchdogs then end the job within
seconds (rlrun/runtime/watchdog.py) and the next ``resume: auto`` continues from the last checkpoint.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_DEADLINE = 44


@contextmanager
def hard_deadline(seconds: float | None, what: str, fix: str) -> Iterator[None]:
    """Run the body; if it is still running after ``seconds`` (None: no limit), print
    ``[rlrun] <what> ran past <seconds> s, stuck at <file:line in fn>; <fix>`` and ``os._exit``."""
    if seconds is None:
        yield
        return
    caller = threading.get_ident()

    def expire() -> None:
        frame = sys._current_frames().get(caller)
        last = traceback.extract_stack(frame)[-1] if frame is not None else None
        where = f", stuck at {last.filename}:{last.lineno} in {last.name}" if last else ""
        print(f"[rlrun] pid {os.getpid()}: {what} ran past {seconds:g} s{where}; {fix}", file=sys.stderr, flush=True)
        os._exit(EXIT_DEADLINE)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
