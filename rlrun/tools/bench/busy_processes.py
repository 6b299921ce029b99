"""Which processes are using the CPU right now: taken between a comparison's runs, where nothing of the
benchmark's should run, it shows a leftover of an earlier run (a Ray daemon, an engine's scheduler) or a neighbour
that a host-bound peer's timings would pay for. Read from /proc, so Linux only."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlrun.tools.bench.procfs import process_stats

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user + system CPU ticks so far: stat(5)'s 14th and 15th fields) of every live process."""
    return {pid: (name, int(fields[11]) + int(fields[12])) for pid, name, fields in process_stats()}


def _command(pid: int, limit: int = 160) -> str:
    """The start of ``pid``'s command line ("" once it has ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return ""


def busy_processes(window_s: float = 1.0, min_fraction: float = 0.05) -> dict:
    """The 1-minute load average and every process that used at least ``min_fraction`` of one core during the
    next ``window_s`` seconds, busiest first (this process left out)."""
    before = _cpu_ticks()
    time.sleep(window_s)
    after = _cpu_ticks()
    busy = []
    for pid, (name, ticks) in after.items():
        if pid == os.getpid() or pid not in before:
            continue
        fraction = (ticks - before[pid][1]) / TICKS_PER_S / window_s
        if fraction >= min_fraction:
            busy.append({"pid": pid, "name": name, "cpu_fraction": round(fraction, 2), "command": _command(pid)})
    busy.sort(key=lambda p: -p["cpu_fraction"])
    return {"loadavg_1m": os.getloadavg()[0], "busy_processes": busy}
