"""Test-only fault points: a real process sends itself a real signal at a named point of its work.

A fault suite that signals a job from outside cannot tell which phase a process is in when the signal
lands (on a loaded machine a "mid-rollout" SIGKILL can land in the weight sync). With
``RLRUN_FAULT_DIR`` set, :func:`reached` checks for the file ``DIR/<pid>.<point>``; when it is there,
the process adds ``time.monotonic()`` to it (when the fault happened: the clock is the machine's),
renames it to ``<pid>.<point>.fired`` and sends itself the signal the file names (``SIGKILL``,
``SIGSTOP``): what the OOM killer or an operator does, at that point by construction. Armed by pid, a
fault fires once (a restarted process has another pid). Unset, as in every real run, a point costs
one dictionary lookup. The suite arms points with ``scripts/faults.py``'s ``arm``.

Points: ``rpc.<method>`` in an RPC server (the engine worker) as a request arrives, before it is
served, so the caller's request is pending; ``checkpoint.write`` on a trainer rank once the save's
temporary directory exists, before the rank writes its part.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

DIR_ENV = "RLRUN_FAULT_DIR"
FIRED = ".fired"


def reached(point: str) -> None:
    """This process is at ``point``: send it the signal armed for it, if one is (see the module docstring)."""
    fault_dir = os.environ.get(DIR_ENV)
    if not fault_dir:
        return
    armed = Path(fault_dir) / f"{os.getpid()}.{point}"
    try:
        name = armed.read_text().strip()
    except OSError:  # not armed
        return
    armed.write_text(f"{name}\n{time.monotonic()!r}\n")
    os.rename(armed, armed.with_name(armed.name + FIRED))
    os.kill(os.getpid(), signal.Signals[name])
