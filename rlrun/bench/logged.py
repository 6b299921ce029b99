"""Run a benchmark's child command with its output in a log file: a run that fails or hangs leaves its
cause readable next to its results, and the benchmark decides whether that ends it or is recorded."""

from __future__ import annotations

import subprocess
from pathlib import Path


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
