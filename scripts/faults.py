"""Inject faults into a running ``torchrun ... rlrun train`` job from outside, as the OS or a user would.

    python scripts/faults.py quickstart      # the fault demonstration, ~5-10 min on 2 CPU cores
    python scripts/faults.py check benchmarks/results/fault_quickstart_cpu_metrics.jsonl   # its checks again

``quickstart`` runs the CPU quickstart with ``engine.max_restarts=2``, SIGKILLs rank 1's engine worker as
step 10 and step 30 begin, and checks what must hold: all 50 steps logged once, ``engine/restarts`` 2,
the reward rising, the trainer-vs-engine log-prob gap below 1e-4 in every step that trained (a step whose
groups all tied trains nothing and logs no gap). Its metrics and a summary go to ``benchmarks/results/``.
The helpers (find a rank's engine worker through /proc, wait for a step, arm a fault point so a process
signals itself in a named phase, rlrun/runtime/fault_points.py) are shared with the fault tests
(tests/integration/test_faults.py, test_checkpoint_faults.py). Processes are found
as children of the torchrun process started here and signalled by pid only.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_KILL_STEPS = (10, 30)
MAX_GAP = 1e-4


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    """The ``RANK`` of process ``pid``; None for a child torchrun has forked but not yet started as a rank (its
    environment is still torchrun's) or one that is gone."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    rank = next((v for v in environ if v.startswith(b"RANK=")), None)
    return None if rank is None else int(rank.split(b"=", 1)[1])


def engine_pids(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid of its engine worker} of the job under ``torchrun_pid`` (ranks with one)."""
    return {rank: kids[0] for rank, pid in rank_pids(torchrun_pid).items() if (kids := children(pid))}


def wait_for_engine(torchrun_pid: int, rank: int, proc: subprocess.Popen, killed: tuple[int, ...] = ()) -> int:
    """Until ``rank``'s engine worker is spawned (one whose pid is not in ``killed``: a restarted worker); its pid.
    Found ahead of the moment a fault is armed: a /proc scan takes a loaded machine long enough for a tiny
    model's job to run past that moment. Raises if the job ends first."""
    deadline = time.monotonic() + 300
    while (worker := engine_pids(torchrun_pid).get(rank)) is None or worker in killed:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled before rank {rank}'s engine started (exit {proc.poll()})")
        time.sleep(0.05)
    return worker


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for_steps(run_dir: Path, num_steps: int, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Until ``num_steps`` steps are logged (so step ``num_steps`` is starting); raises if the job ends first."""
    deadline = time.monotonic() + timeout_s
    while len(read_metrics(run_dir)) < num_steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled before step {num_steps} (exit {proc.poll()})")
        time.sleep(0.005)


def rank_pids(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of the job under ``torchrun_pid`` (its ranks started so far)."""
    return {rank: pid for pid in children(torchrun_pid) if (rank := rank_of(pid)) is not None}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_work(engine_pid: int, cpu_s: float = 0.01, timeout_s: float = 300) -> bool:
    """Until the engine has used ``cpu_s`` of CPU since the call: an idle worker only answers heartbeats,
    so called between steps this returns inside the next rollout's generate. False if the worker is gone."""
    deadline = time.monotonic() + timeout_s
    try:
        start = cpu_seconds(engine_pid)
        while cpu_seconds(engine_pid) - start < cpu_s:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
    except OSError:
        return False
    return True


def arm(fault_dir: Path, pid: int, point: str, signal_name: str) -> None:
    """Make process ``pid`` send itself ``signal_name`` when it next reaches ``point``
    (rlrun/runtime/fault_points.py; the job runs with ``RLRUN_FAULT_DIR=fault_dir``)."""
    armed = fault_dir / f"{pid}.{point}"
    partial = armed.with_name(armed.name + ".partial")
    partial.write_text(signal_name)
    os.rename(partial, armed)  # never seen half-written


def wait_fired(fault_dir: Path, pid: int, point: str, proc: subprocess.Popen, timeout_s: float = 300) -> float:
    """Until the fault armed for ``pid`` at ``point`` has fired; its ``time.monotonic()`` (the machine's clock).
    Raises if the job ends first."""
    fired = fault_dir / f"{pid}.{point}.fired"
    deadline = time.monotonic() + timeout_s
    while not fired.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job ended or stalled before {point} of pid {pid} (exit {proc.poll()})")
        time.sleep(0.005)
    return float(fired.read_text().split()[1])


class Job:
    """A torchrun job in its own session, its output read into timestamped lines. ``max_file_bytes`` caps the
    size of any file its processes write (RLIMIT_FSIZE, ``ulimit -f``; Python ignores SIGXFSZ, so a write past
    it fails with ``OSError: [Errno 27] File too large``, as one on a full disk fails with errno 28)."""

    def __init__(self, command: list[str], env: dict[str, str], max_file_bytes: int | None = None) -> None:
        self.start = time.monotonic()
        self.lines: list[tuple[float, str]] = []

        def limit_files() -> None:
            if max_file_bytes is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

        self.proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=limit_files,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first_line_after(self, since: float, text: str) -> tuple[float, str] | None:
        """The first output line containing ``text`` at or after monotonic time ``since``."""
        return next(((t, line) for t, line in self.lines if t >= since and text in line), None)

    def wait_for_line(self, pattern: re.Pattern, count: int = 1, timeout_s: float = 300) -> re.Match:
        """The ``count``-th match of ``pattern`` in the output, once it is there; raises if the job ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            ended = self.proc.poll() is not None
            found = [m for _, line in list(self.lines) if (m := pattern.search(line))]
            if len(found) >= count:
                return found[count - 1]
            if ended or time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern.pattern!r} #{count} before the job ended (exit {self.proc.poll()})")
            time.sleep(0.01)

    def tail(self, num_lines: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-num_lines:])

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        """SIGKILL what is left: torchrun's session (its ranks, their engine workers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def summarize(metrics: list[dict]) -> dict:
    """The quickstart fault run's figures and checks from its metrics. A step whose groups all tied trains nothing
    (``algorithm.skip_tied_groups``), so it compares no log-probs and logs no gap."""
    trained = [m for m in metrics if "train/logprob_gap" in m]
    rewards = [m["rollout/raw_reward_mean"] for m in metrics]
    first, last = sum(rewards[:10]) / max(len(rewards[:10]), 1), sum(rewards[-10:]) / max(len(rewards[-10:]), 1)
    out = {
        "steps_logged": [m["step"] for m in metrics],
        "engine_restarts_final": metrics[-1].get("engine/restarts") if metrics else None,
        "restart_s": {m["step"]: m["engine/restart_s"] for m in metrics if m.get("engine/restart_s")},
        "steps_trained": len(trained),
        "steps_all_groups_tied": [m["step"] for m in metrics if "train/logprob_gap" not in m],
        "max_logprob_gap": max((m["train/logprob_gap"] for m in trained), default=None),
        "reward_first10_mean": first,
        "reward_last10_mean": last,
    }
    out["checks"] = {
        "all 50 steps once": out["steps_logged"] == list(range(50)),
        "engine/restarts == 2": out["engine_restarts_final"] == 2,
        "reward rises": last > first,
        "gap < 1e-4 every step that trained": bool(trained) and out["max_logprob_gap"] < MAX_GAP,
        "steps without a gap had every group tied": all(
            m["rollout/tied_group_frac"] == 1.0 for m in metrics if "train/logprob_gap" not in m
        ),
    }
    return out


def quickstart(out_dir: Path, run_dir: Path) -> dict:
    """The fault demonstration: the CPU quickstart with rank 1's engine worker killed twice; returns the summary
    (also written to ``out_dir``)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "rlrun", "train", "configs/quickstart.yaml", "--set", "engine.max_restarts=2"]
    command += ["--set", f"logging.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    job, kills = Job(command, env), []
    try:
        for step in QUICKSTART_KILL_STEPS:
            wait_for_steps(run_dir, step, job.proc)
            victim = engine_pids(job.proc.pid)[1]
            wait_for_work(victim)  # inside step's rollout
            os.kill(victim, signal.SIGKILL)
            kills.append({"step": step, "pid": victim, "at": time.monotonic()})
        code = job.wait(timeout_s=1800)
    finally:
        job.kill()
    metrics = read_metrics(run_dir)
    for kill in kills:
        killed_at = kill.pop("at")
        seen = job.first_line_after(killed_at, "lost in")
        kill["detected_after_s"] = round(seen[0] - killed_at, 2) if seen else None
        kill["message"] = seen[1][:400] if seen else None
    summary = {"command": " ".join(command[1:]), "exit_code": code, **summarize(metrics), "kills": kills}
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / "metrics.jsonl", out_dir / "fault_quickstart_cpu_metrics.jsonl")
    (out_dir / "fault_quickstart_cpu_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    if sys.argv[1:] == ["quickstart"]:
        summary = quickstart(REPO / "benchmarks/results", REPO / "runs/fault_quickstart")
    elif sys.argv[1:2] == ["check"] and len(sys.argv) == 3:  # the checks again, from a metrics.jsonl
        lines = Path(sys.argv[2]).read_text().splitlines()
        summary = summarize([json.loads(line) for line in lines if line.strip()])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
