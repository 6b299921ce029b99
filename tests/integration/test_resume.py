"""Exact resume through the real CLI under torchrun (2 ranks, embedded engines, Megatron on gloo).

Reference: one uninterrupted 6-step run. The same run is stopped by SIGTERM sent to the whole
process group, as Slurm does on preemption (torchrun, both ranks and both engine workers get it),
and continued with ``checkpoint.resume: auto``: every step's rewards, losses and gradient norms must
equal the reference's exactly, which needs the model, optimizer, sampler cursor, weight version and
the engine's weights (re-synced from the checkpoint) all restored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minimal_config import tiny_task_settings

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def train_command(model_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node 2 -m rlrun train`` on the tiny model's learnable task."""
    settings = [
        *tiny_task_settings(model_dir, run_dir),
        *overrides,
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "rlrun",
        "train",
        str(REPO / "configs/quickstart.yaml"),
        *[a for s in settings for a in ("--set", s)],
    ]


def train_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_to_end(model_dir: Path, run_dir: Path, *overrides: str) -> str:
    proc = subprocess.run(
        train_command(model_dir, run_dir, *overrides),
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def run_until_sigterm(model_dir: Path, run_dir: Path, after_steps: int, *overrides: str) -> str:
    """Start a run, SIGTERM its whole process group once ``after_steps`` steps are logged; its output."""
    proc = subprocess.Popen(
        train_command(model_dir, run_dir, *overrides),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(read_metrics(run_dir)) < after_steps and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"run ended before the signal:\n{proc.stdout.read()[-5000:]}"
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return output


def comparable(record: dict) -> dict:
    """Everything but wall-clock times."""
    return {k: v for k, v in record.items() if not k.startswith("time/")}


def test_sigterm_checkpoint_then_resume_matches_uninterrupted_run(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["qwen3"]
    run_to_end(model, tmp_path / "straight", "train.num_steps=6")
    reference = read_metrics(tmp_path / "straight")

    run_dir = tmp_path / "interrupted"
    output = run_until_sigterm(model, run_dir, 2, "train.num_steps=6")
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "COMPLETE").is_file(), output[-5000:]
    stopped_at = json.loads((checkpoints[0] / "run_state.json").read_text())["step"]
    assert 2 <= stopped_at < 6, output[-5000:]
    assert "SIGTERM received" in output
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(stopped_at))

    # Continue to step 6, saving asynchronously after every step and keeping the newest two.
    output = run_to_end(
        model,
        run_dir,
        "train.num_steps=6",
        "checkpoint.resume=auto",
        "checkpoint.save_interval=1",
        "checkpoint.async_save=true",
        "checkpoint.keep_last=2",
    )
    assert f"resumed from {checkpoints[0]} (step {stopped_at})" in output
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(6))
    for got, want in zip(resumed, reference, strict=False):
        assert comparable(got) == comparable(want), f"step {want['step']} differs after resuming at {stopped_at}"
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_000005", "step_000006"], kept
    assert all((run_dir / "checkpoints" / name / "COMPLETE").is_file() for name in kept)
