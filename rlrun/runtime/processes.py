"""Process facts from procfs for watchdogs and memory accounting on both sides of the trainer/engine
boundary (stdlib only, so the engine worker can use it without importing torch.distributed)."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """False once ``pid`` has exited or is a zombie (killed but not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except FileNotFoundError:  # exited just now, or no procfs (then kill(pid, 0) is all we know)
        return not Path("/proc/self").exists()
    return state not in ("Z", "X")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (children of all its threads): an SGLang engine's GPU memory
    is held by scheduler processes its worker started, not by the worker itself. ``[pid]`` without procfs."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in children.read_text().split())
            except OSError:  # the thread or the process ended meanwhile
                continue
    return found
