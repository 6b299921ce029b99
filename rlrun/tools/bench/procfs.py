"""Every live process's ``/proc/<pid>/stat`` (Linux): what the benchmarks read between runs to find processes
of a finished run's session (rlrun/tools/bench/logged.py) or processes using the CPU
(rlrun/tools/bench/busy_processes.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def process_stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the fields after the name) of each process: ``fields[0]`` is the state, the 3rd field
    of stat(5), so field n of stat(5) is ``fields[n - 3]``. The name is in parentheses and may hold spaces or
    parentheses itself, hence the split at the last ``)``. A process that ends meanwhile is skipped."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, tail = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        yield int(stat.parent.name), head.split("(", 1)[1], tail.split()
