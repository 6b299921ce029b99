"""rlrun/tools/bench/busy_processes.py: a process spinning on a core is listed, a sleeping one is not (the spinner
shares the cores with whatever else runs, so it is asked for a tenth of one)."""

from __future__ import annotations

import subprocess
import sys

from rlrun.tools.bench.busy_processes import busy_processes


def test_a_spinning_process_is_listed_and_a_sleeping_one_is_not():
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = busy_processes(window_s=1.0)
    finally:
        spinning.kill()
        sleeping.kill()
    by_pid = {p["pid"]: p for p in state["busy_processes"]}
    assert by_pid[spinning.pid]["cpu_fraction"] > 0.1 and by_pid[spinning.pid]["name"].startswith("python")
    assert by_pid[spinning.pid]["command"].endswith("-c while True: pass")
    assert sleeping.pid not in by_pid
    assert state["loadavg_1m"] >= 0
