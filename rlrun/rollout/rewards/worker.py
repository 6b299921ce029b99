"""A reward process (:mod:`.processes`): reads pickled ``(function, argument)`` requests on stdin, answers each
with a pickled ``(True, value)`` or ``(False, "Type: message")``. Started as
``python -m rlrun.rollout.rewards.worker <parent pid>``; what the reward prints goes to stderr, so it cannot
corrupt the replies. Ends at the end of stdin, or with its parent (``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import pickle
import signal
import sys

from rlrun.rollout.rewards.processes import read_message, write_message

_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the worker still ends at the end of its stdin
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _call(fn, argument):
    result = fn(argument)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def main() -> None:
    _die_with(int(sys.argv[1]))
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the reward's prints go to stderr
    requests = sys.stdin.buffer
    while (request := read_message(requests)) is not None:
        try:
            fn, argument = pickle.loads(request)
            reply = (True, _call(fn, argument))
        except Exception as err:  # noqa: BLE001 - a user reward may raise anything; the parent records it
            reply = (False, f"{type(err).__name__}: {err}")
        try:
            payload = pickle.dumps(reply)
        except Exception as err:  # noqa: BLE001 - an unpicklable result is the reward's error
            payload = pickle.dumps((False, f"TypeError: the reward's result cannot cross processes: {err}"))
        write_message(replies, payload)


if __name__ == "__main__":
    main()
