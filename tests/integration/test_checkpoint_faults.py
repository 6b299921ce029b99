"""Faults during a checkpoint save, in a real 2-rank job (torchrun, Megatron on gloo, embedded engines), and what
the next ``resume: auto`` does. One run directory, two jobs:

    job 1  saves step_000001, then rank 1 is SIGKILLed as it starts writing the next checkpoint (armed once
           the first is saved; a fault point, rlrun/runtime/fault_points.py: in the save by construction)
           -> rank 0 names the dead rank and the phase; only .tmp-step_N/ is left
    job 2  resume: auto (from the one before it, past the half-written step), every file capped at 512 KiB
           (RLIMIT_FSIZE: the full disk; no mount needed) -> the next save fails on rank 0's shard,
           the job stops naming the rank, the checkpoint and the errno; again only .tmp-step_N/ is left

A file-size limit rather than a small tmpfs or loop file: mounting needs root (or a user namespace, whose
mount ends with the job, before the next job could resume from it), and both writes fail alike (EFBIG here,
ENOSPC on a full disk; torch's zip writer turns either into ``unexpected pos``, the errno kept as context).

Asserted: the one-line causes, every process gone, no ``step_N`` without its ``COMPLETE`` marker, and
``resume: auto`` picking the last complete checkpoint each time (job 2 shows it does, with job 1's
half-written step present; after job 2 the directory holds that same state).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from test_failure import alive
from test_resume import train_command, train_env

from rlrun.runtime.fault_points import DIR_ENV

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from faults import Job, arm, engine_pids, rank_pids, read_metrics, wait_fired  # noqa: E402

pytestmark = pytest.mark.slow

FILE_LIMIT = 512 * 1024
"""Above the tiny model's weight buckets (/dev/shm files) and logs, below rank 0's checkpoint shards (~800 KB)."""
SAVED = re.compile(r"\[rlrun\] checkpoint saved: (\S+)")


def half_written(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if not (p / "COMPLETE").is_file())


def test_kill_and_full_disk_mid_checkpoint_leave_only_the_last_complete_one(tiny_model_dirs, tmp_path):
    from rlrun.config.schema import CheckpointConfig
    from rlrun.trainer.checkpoint import resolve_start

    run_dir, fault_dir = tmp_path / "run", tmp_path / "faults"
    ckpt_dir = run_dir / "checkpoints"
    fault_dir.mkdir()
    command = train_command(tiny_model_dirs["qwen3"], run_dir, "checkpoint.save_interval=1", "train.num_steps=8")
    job = Job(command, {**train_env(), DIR_ENV: str(fault_dir)})
    try:
        first = job.wait_for_line(SAVED)[1]
        ranks = rank_pids(job.proc.pid)
        processes = [job.proc.pid, *ranks.values(), *engine_pids(job.proc.pid).values()]
        arm(fault_dir, ranks[1], "checkpoint.write", "SIGKILL")  # fires in the next save
        killed = wait_fired(fault_dir, ranks[1], "checkpoint.write", job.proc)
        code = job.wait(timeout_s=120)
    finally:
        job.kill()
    output = "\n".join(line for _, line in job.lines)
    assert Path(first).name == "step_000001" and code != 0, output[-3000:]
    assert not any(alive(pid) for pid in processes), [p for p in processes if alive(p)]
    (tmp,) = half_written(ckpt_dir)
    step = int(tmp.removeprefix(".tmp-step_"))
    died = job.first_line_after(killed, "exiting: ")
    assert died and re.search(
        rf"rank 0 \(pid {ranks[0]} on \S+\) exiting: rank 1 \(pid {ranks[1]} on \S+\) died: its process is gone "
        rf".* at step {step} \(checkpoint\)",
        died[1],
    ), died
    start = resolve_start(CheckpointConfig(resume="auto"), ckpt_dir)
    assert start is not None and start.name == f"step_{step - 1:06d}", (start, step)

    # The full disk, in the job that resumes past the half-written checkpoint.
    job = Job(command, train_env(), max_file_bytes=FILE_LIMIT)
    try:
        resumed = job.wait_for_line(re.compile(r"\[rlrun\] resumed from (\S+) \(step (\d+)\)"))
        code = job.wait(timeout_s=300)
        ended = time.monotonic()
    finally:
        job.kill()
    output = "\n".join(line for _, line in job.lines)
    assert Path(resumed[1]) == start and code != 0, output[-3000:]
    failed = job.first_line_after(0.0, "(checkpoint): CheckpointWriteError: ")
    assert failed and re.search(
        rf"rank (\d) \(pid \d+ on \S+\) failed at step {step} \(checkpoint\): CheckpointWriteError: rank \1 could not "
        rf"write its part of checkpoint step_{step:06d} in {re.escape(str(ckpt_dir))}: OSError: \[Errno 27\] File too "
        r"large \([\d.]+ GiB free there\); the half-written ",
        failed[1],
    ), output[-3000:]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(step)), output[-3000:]  # step-1 ran again
    assert half_written(ckpt_dir) == [tmp]
    assert resolve_start(CheckpointConfig(resume="auto"), ckpt_dir) == start
    print(
        f"rank killed mid-checkpoint: detected after {died[0] - killed:.2f} s; "
        f"full disk: the job ended {ended - failed[0]:.1f} s after the failure was published"
    )
