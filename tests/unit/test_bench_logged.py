"""rlrun/tools/bench/logged.py run_logged_session: a command's daemons in process groups of their own (as Ray's
workers are) do not outlive it, whether it exits or times out. Real processes, found through /proc."""

from __future__ import annotations

import os
import sys

import pytest

from rlrun.tools.bench.logged import run_logged_session

DAEMON = (
    "import subprocess, sys, time; "
    "p = subprocess.Popen(['sleep', '60'], process_group=0); print(p.pid, flush=True); time.sleep(float(sys.argv[1]))"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie awaiting its reaper is gone too
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize(("runs_s", "timeout_s", "expected"), [(0.0, 20.0, 0), (30.0, 1.0, "timeout")])
def test_daemons_of_the_session_end_with_it(tmp_path, runs_s, timeout_s, expected):
    log = tmp_path / "run.log"
    code = run_logged_session([sys.executable, "-c", DAEMON, str(runs_s)], log, timeout_s)
    daemon = int(log.read_text().split()[0])
    assert code == expected
    assert not alive(daemon)  # run_logged would have left it: its own process group, its parent gone
