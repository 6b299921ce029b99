"""A reward process (:mod:`.processes`): reads pickled ``(function, argument)`` requests on stdin, answers each
with a pickled ``(True, value)`` or ``(False, "Type: message")``. Started as
``python -m rlrun.rollout.rewards.worker <parent pid>``; what the reward prints goes to stderr, so it cannot
corrupt the replies. Ends at the end of stdin, or when its parent is gone."""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import sys
import threading
import time

from rlrun.rollout.rewards.processes import READY, read_message, write_message
from rlrun.runtime.hooks import raised


def _die_with(parent_pid: int) -> None:
    """End this process when the rank that started it is gone, even while a reward hangs in it. (Not
    ``PR_SET_PDEATHSIG``: that fires when the parent *thread* ends, and workers are started from short-lived
    scoring threads.)"""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="rlrun-reward-parent-watch", daemon=True).start()


def _call(fn, argument):
    result = fn(argument)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def main() -> None:
    _die_with(int(sys.argv[1]))
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the reward's prints go to stderr
    requests = sys.stdin.buffer
    write_message(replies, READY)
    while (request := read_message(requests)) is not None:
        try:
            fn, argument = pickle.loads(request)
            reply = (True, _call(fn, argument))
        except Exception as err:  # noqa: BLE001 - a user reward may raise anything; the parent records it
            reply = (False, raised(err))
        try:
            payload = pickle.dumps(reply)
        except Exception as err:  # noqa: BLE001 - an unpicklable result is the reward's error
            payload = pickle.dumps((False, f"TypeError: the reward's result cannot cross processes: {err}"))
        write_message(replies, payload)


if __name__ == "__main__":
    main()
