"""Why a process (an engine worker) died, in the words of the one-line failure message.

An exit code alone says little: ``-9`` is the kernel's OOM killer (host memory) as often as a user's
``kill -9``, and ``1`` may be CUDA running out of memory or any Python exception. The evidence read
here, each where readable: the cgroup's OOM-kill counters (cgroup v2 ``memory.events``, v1
``memory.oom_control``) compared with their values when the worker started, the kernel log
(``/dev/kmsg``, often restricted), and the end of the worker's log. Stdlib only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
TAIL_BYTES = 16384
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def oom_kill_counts() -> dict[str, int]:
    """The OOM-kill counters of this process's cgroup and its ancestors (path -> count; {} unreadable)."""
    counts: dict[str, int] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, name = CGROUP_ROOT, "memory.events"
        elif "memory" in controllers.split(","):  # v1
            base, name = CGROUP_ROOT / "memory", "memory.oom_control"
        else:
            continue
        node = base / path.lstrip("/")
        while True:
            count = _oom_kill(node / name)
            if count is not None:
                counts[str(node / name)] = count
            if node == base or base not in node.parents:
                break
            node = node.parent
    return counts


def _oom_kill(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _kernel_log_oom(pid: int) -> str | None:
    """The kernel's OOM line for ``pid`` from /dev/kmsg, or None (not found or not readable)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: the ring buffer overwrote what we were reading; read on
                continue
            if not record:
                break
            if f"Killed process {pid} " in record:
                found = record.split(";", 1)[-1].strip()
    finally:
        os.close(fd)
    return found


def _sigkill_cause(pid: int, oom_before: dict[str, int] | None) -> str:
    kernel = _kernel_log_oom(pid)
    if kernel:
        return f"the kernel's OOM killer (host memory): {kernel}"
    after = oom_kill_counts()
    if oom_before and after:
        rose = [f"{p} oom_kill {oom_before[p]} -> {n}" for p, n in after.items() if n > oom_before.get(p, n)]
        if rose:
            return f"the kernel's OOM killer (host memory): {rose[0]}"
        return "not the OOM killer (the cgroup's oom_kill counts did not change): another process sent it"
    return "possibly the OOM killer; no cgroup or kernel log evidence was readable"


def log_cause(log_path: Path | None) -> str | None:
    """CUDA out of memory, or a Python exception with its last frame, from the end of the log."""
    if log_path is None or not log_path.exists():
        return None
    with log_path.open("rb") as f:
        f.seek(max(0, log_path.stat().st_size - TAIL_BYTES))
        lines = [line.rstrip() for line in f.read().decode(errors="replace").splitlines()]
    if not any(line.startswith("Traceback (most recent call last)") for line in lines):
        return None
    start = max(i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)"))
    body = lines[start + 1 :]
    frames = [m for m in map(_FRAME.match, body) if m]
    last = next((line for line in reversed(body) if line and not line.startswith(" ")), "")
    where = f" at {Path(frames[-1][1]).name}:{frames[-1][2]} in {frames[-1][3]}" if frames else ""
    if "CUDA out of memory" in last or "OutOfMemoryError" in last:
        return f"CUDA out of memory{where}: {last[:300]}"
    return f"Python exception{where}: {last[:300]}"


@dataclass(frozen=True)
class WatchedProcess:
    """A worker process whose exit is explained in one line (:meth:`exit_note`): its log, and the OOM-kill
    counters taken once when it started, so the engine client and the watchdog compare with the same ones (a
    kill of the worker itself before the watchdog looks is still counted as evidence)."""

    process: subprocess.Popen
    log_path: Path | None
    oom_kills: dict[str, int] = field(default_factory=lambda: oom_kill_counts())

    def exit_note(self) -> str | None:
        """None while the process runs, else :func:`describe_exit`'s line."""
        code = self.process.poll()
        return None if code is None else describe_exit(self.process.pid, code, self.log_path, self.oom_kills)


def describe_exit(pid: int, code: int, log_path: Path | None, oom_before: dict[str, int] | None) -> str:
    """``exited with code C (why)``, one line: the signal (for SIGKILL, whether the OOM killer sent
    it), CUDA out of memory, or the Python exception and its last frame from the log."""
    if code < 0:
        name = signal.Signals(-code).name
        why = _sigkill_cause(pid, oom_before) if -code == signal.SIGKILL else "a signal"
        return f"exited with code {code} (killed by {name}: {why})"
    cause = log_cause(log_path)
    return f"exited with code {code}" + (f" ({cause})" if cause else "")
