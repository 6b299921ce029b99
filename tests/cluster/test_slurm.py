"""launch/slurm_1node.sbatch submitted to a real Slurm (launch/ci/slurm_up.sh starts one on this host).

The GPU script runs unchanged: sbatch's command-line options override its #SBATCH lines (no GPUs, this host's
CPUs) and GPUS_PER_NODE sets the ranks. One job runs to the end and its job-completion record says COMPLETED;
a second one gets ``scancel --signal=USR1`` (what ``#SBATCH --signal=USR1@300`` sends before the time limit)
after its first step, checkpoints and stops; ``scontrol requeue`` runs the same job again, which resumes, and
its metrics equal the uninterrupted job's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from minimal_config import tiny_task_settings

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 20
"""Enough that the USR1 sent after the first step lands before the last: the tiny model's steps take ~0.1 s on an idle
machine, and four of them ended the job before the signal arrived."""


def slurm_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return proc.returncode == 0 and "idle" in proc.stdout


if not slurm_up():
    pytest.skip("no Slurm with an idle node here: start one with bash launch/ci/slurm_up.sh", allow_module_level=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def submit(run_dir: Path, model_dir: Path, *extra_sbatch: str) -> int:
    """``sbatch launch/slurm_1node.sbatch configs/quickstart.yaml`` on CPU: 2 ranks, the tiny model."""
    settings = [
        *tiny_task_settings(model_dir, run_dir),
        f"train.num_steps={NUM_STEPS}",
    ]
    env = {
        **os.environ,
        "GPUS_PER_NODE": "2",
        "RDZV_PORT": str(free_port()),
        "RLRUN_LOG_DIR": str(run_dir / "slurm-logs"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(REPO),
    }
    command = [
        "sbatch",
        "--parsable",
        "--gpus-per-node=0",
        f"--cpus-per-task={os.cpu_count()}",
        f"--output={run_dir}/slurm-%j.out",
        *extra_sbatch,
        "launch/slurm_1node.sbatch",
        "configs/quickstart.yaml",
        *[a for s in settings for a in ("--set", s)],
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().split(";")[0])


def job_state(job: int) -> str:
    """The job's state as slurmctld reports it (``scontrol show job``)."""
    proc = subprocess.run(["scontrol", "show", "job", str(job)], capture_output=True, text=True, check=True)
    return next(f.split("=", 1)[1] for f in proc.stdout.split() if f.startswith("JobState="))


def wait_for(job: int, states: set[str], timeout_s: float = 900) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := job_state(job)) not in states:
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout_s} s"
        time.sleep(1)
    return state


def completion_records(job: int) -> list[str]:
    """``sacct -c`` lines of ``job`` (job-completion records: JobCompType=jobcomp/filetxt)."""
    proc = subprocess.run(
        ["sacct", "-c", "-n", "-P", "-j", str(job), "-o", "JobID,JobName,State,ExitCode,Elapsed"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in proc.stdout.splitlines() if line]


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("time/")}


def job_output(run_dir: Path, job: int) -> str:
    path = run_dir / f"slurm-{job}.out"
    return path.read_text()[-5000:] if path.exists() else "(no job output)"


def test_sbatch_runs_to_completion_and_usr1_then_requeue_resumes_exactly(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["qwen3"]
    straight = tmp_path / "straight"
    job = submit(straight, model)
    assert wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}) == "COMPLETED", job_output(straight, job)
    record = completion_records(job)
    assert len(record) == 1 and record[0].split("|")[2] == "COMPLETED", record
    reference = metrics(straight)
    assert [r["step"] for r in reference] == list(range(NUM_STEPS))

    run_dir = tmp_path / "interrupted"
    job = submit(run_dir, model)
    deadline = time.monotonic() + 900
    while not metrics(run_dir) and job_state(job) in {"PENDING", "RUNNING"}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", str(job)], check=True)
    assert wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", job_output(run_dir, job)
    first = job_output(run_dir, job)
    assert "SIGUSR1 received" in first, first
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "COMPLETE").is_file(), first
    stopped_at = json.loads((checkpoints[0] / "run_state.json").read_text())["step"]
    assert 1 <= stopped_at < NUM_STEPS, first

    # The same job again (what a preempted job's requeue does): checkpoint.resume auto continues it.
    subprocess.run(["scontrol", "requeue", str(job)], check=True)
    time.sleep(2)  # the requeued job goes PENDING, then RUNNING
    assert wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", job_output(run_dir, job)
    # jobcomp records the stop, the requeue (PENDING) and the resumed run
    assert [r.split("|")[2] for r in completion_records(job)] == ["COMPLETED", "PENDING", "COMPLETED"]
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(NUM_STEPS)), job_output(run_dir, job)
    assert [comparable(r) for r in resumed] == [comparable(r) for r in reference]
