"""Run a benchmark's child command with its output in a log file: a run that fails or hangs leaves its
cause readable next to its results, and the benchmark decides whether that ends it or is recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from rlrun.tools.bench.procfs import process_stats


def run_logged(
    cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> int | str:
    """``cmd``'s exit code, or ``"timeout"`` once it has run ``timeout_s`` seconds (then killed); stdout and
    stderr go to ``log``."""
    with log.open("w") as sink:
        try:
            return subprocess.run(
                cmd, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def run_logged_session(
    cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> int | str:
    """:func:`run_logged` for a command that starts daemons (Ray): it runs in a session of its own, and every
    process of that session is killed once it ends or times out. Ray gives its workers process groups of
    their own, which outlive a driver that exited or was killed (with their device memory), so the
    session is what holds them all; the next run gets a free device."""
    with log.open("w") as sink:
        child = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout"
        finally:
            end_session(child.pid)
            child.wait()


def session_pids(sid: int) -> list[int]:
    """The live processes of session ``sid`` (stat(5)'s 6th field); zombies, dead and waiting for their parent to
    reap them, are left out."""
    return [pid for pid, _, fields in process_stats() if int(fields[3]) == sid and fields[0] != "Z"]


def end_session(sid: int, wait_s: float = 30.0) -> None:
    """SIGKILL every process of session ``sid`` until none is left (or ``wait_s`` has passed)."""
    deadline = time.monotonic() + wait_s
    while (pids := session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
