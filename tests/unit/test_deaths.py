"""The one-line cause of a dead worker (rlrun/runtime/deaths.py), from real processes that die each way."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from rlrun.runtime import deaths


def run_dying(tmp_path: Path, code: str) -> tuple[int, int, Path]:
    """Run ``code`` in a fresh Python with its output in a log, as the engine worker runs; (pid, exit code, log)."""
    script, log = tmp_path / "worker_main.py", tmp_path / "worker.log"
    script.write_text(textwrap.dedent(code))
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(script)], stdout=out, stderr=subprocess.STDOUT)
        return proc.pid, proc.wait(timeout=60), log


def test_python_exception_is_named_with_its_last_frame(tmp_path):
    pid, code, log = run_dying(
        tmp_path,
        """
        def load_model(path):
            raise OSError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'")
        load_model(".cache/models/x")
        """,
    )
    assert deaths.describe_exit(pid, code, log, None) == (
        "exited with code 1 (Python exception at worker_main.py:3 in load_model: OSError: Repo id must be in the "
        "form 'repo_name' or 'namespace/repo_name': '.cache/models/x')"
    )


def test_cuda_out_of_memory_is_told_apart_from_other_exceptions(tmp_path):
    pid, code, log = run_dying(
        tmp_path,
        """
        import sys
        class OutOfMemoryError(RuntimeError):
            pass
        OutOfMemoryError.__module__ = "torch"
        def forward():
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        forward()
        """,
    )
    message = deaths.describe_exit(pid, code, log, None)
    assert message.startswith("exited with code 1 (CUDA out of memory at worker_main.py:7 in forward: "), message
    assert message.endswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"), message


def test_sigkill_with_and_without_oom_evidence(tmp_path, monkeypatch):
    before = {"/sys/fs/cgroup/job/memory.events": 3}
    pid, code, log = run_dying(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert code == -signal.SIGKILL
    monkeypatch.setattr(deaths, "_kernel_log_oom", lambda pid: None)  # /dev/kmsg is usually not readable
    monkeypatch.setattr(deaths, "oom_kill_counts", lambda: {"/sys/fs/cgroup/job/memory.events": 4})
    assert deaths.describe_exit(pid, code, log, before) == (
        "exited with code -9 (killed by SIGKILL: the kernel's OOM killer (host memory): "
        "/sys/fs/cgroup/job/memory.events oom_kill 3 -> 4)"
    )
    monkeypatch.setattr(deaths, "oom_kill_counts", lambda: dict(before))
    assert "killed by SIGKILL: not the OOM killer (the cgroup's oom_kill counts did not change)" in (
        deaths.describe_exit(pid, code, log, before)
    )
    monkeypatch.setattr(deaths, "oom_kill_counts", dict)  # nothing readable
    assert deaths.describe_exit(pid, code, log, None).endswith(
        "(killed by SIGKILL: possibly the OOM killer; no cgroup or kernel log evidence was readable)"
    )


def test_other_signals_and_this_hosts_counters(tmp_path):
    pid, code, log = run_dying(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert deaths.describe_exit(pid, code, log, None) == "exited with code -11 (killed by SIGSEGV: a signal)"
    assert all(path.endswith(("memory.events", "memory.oom_control")) for path in deaths.oom_kill_counts())


def test_a_watched_process_is_judged_by_the_counters_of_its_start(monkeypatch):
    """The engine client and the watchdog read one ``WatchedProcess``: a kill is compared with the counters taken
    when it was made (the worker's spawn), not with those of whoever looks later."""
    monkeypatch.setattr(deaths, "_kernel_log_oom", lambda pid: None)
    monkeypatch.setattr(deaths, "oom_kill_counts", lambda: {"/sys/fs/cgroup/job/memory.events": 3})
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watched = deaths.WatchedProcess(process, None)
    try:
        assert watched.exit_note() is None  # still running
        monkeypatch.setattr(deaths, "oom_kill_counts", lambda: {"/sys/fs/cgroup/job/memory.events": 4})
    finally:
        process.kill()
        process.wait()
    assert watched.exit_note() == (
        "exited with code -9 (killed by SIGKILL: the kernel's OOM killer (host memory): "
        "/sys/fs/cgroup/job/memory.events oom_kill 3 -> 4)"
    )
