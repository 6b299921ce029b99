"""Fault injection into a real 2-rank job (torchrun, Megatron on gloo, embedded engine workers): one run,
three engine faults, ``engine.max_restarts=2``. Each is armed between steps as a fault point
(rlrun/runtime/fault_points.py): the worker sends itself the signal as the named request arrives, so it
lands in that phase however loaded the machine is (watching CPU time from outside once caught a sync).

    a rollout         SIGKILL rank 1's engine as a generate arrives       -> restarted, the rollout redone
    a later sync      SIGKILL rank 0's engine as a weight bucket arrives  -> restarted, re-synced, the step stands
    a later rollout   SIGSTOP rank 1's engine (frozen, not dead)          -> the third loss: the job ends

Asserted on ``metrics.jsonl``, the checkpoint and the job's output: every step logged exactly once, the
restart counts, the trainer-vs-engine gap (the restarted engines hold the current weights), the lost
rollout drew no prompts (the sampler cursor in the last checkpoint), one-line causes naming rank,
phase and signal, every process gone, and what ``resume: auto`` would start from. Detection times are
printed (README's fault table).
"""

from __future__ import annotations

import json
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
from faults import Job, arm, engine_pids, rank_pids, read_metrics, wait_fired, wait_for_steps  # noqa: E402

pytestmark = pytest.mark.slow

HEARTBEAT_S = 2.0
NUM_STEPS = 10  # the third fault ends the job at step 4-6; the rest is margin for a slow test process
RESTART_LINE = re.compile(r"\[rlrun\] rank 0: restarting the engine of rank\(s\) \[\d\] at step (\d+)")


def test_engine_faults_restart_in_place_until_max_restarts(tiny_model_dirs, tmp_path):
    from rlrun.config.schema import CheckpointConfig
    from rlrun.trainer.checkpoint import resolve_start

    run_dir, fault_dir = tmp_path / "run", tmp_path / "faults"
    fault_dir.mkdir()
    settings = ["engine.max_restarts=2", f"engine.heartbeat_timeout_s={HEARTBEAT_S}"]
    settings += ["checkpoint.save_interval=2", f"train.num_steps={NUM_STEPS}"]
    job = Job(train_command(tiny_model_dirs["qwen3"], run_dir, *settings), {**train_env(), DIR_ENV: str(fault_dir)})
    faults: dict[str, float] = {}
    try:
        wait_for_steps(run_dir, 1, job.proc, timeout_s=300)
        engines, ranks = engine_pids(job.proc.pid), rank_pids(job.proc.pid)  # found early: /proc scans are slow
        processes = [job.proc.pid, *ranks.values(), *engines.values()]
        # Each fault is armed between steps and fires in the phase named, in the next step that has it.
        arm(fault_dir, engines[1], "rpc.generate", "SIGKILL")
        faults["kill -9 mid-rollout"] = wait_fired(fault_dir, engines[1], "rpc.generate", job.proc)
        wait_for_steps(run_dir, int(job.wait_for_line(RESTART_LINE)[1]) + 1, job.proc)

        arm(fault_dir, engines[0], "rpc.update_weights_from_tensor", "SIGKILL")
        faults["kill -9 mid-sync"] = wait_fired(fault_dir, engines[0], "rpc.update_weights_from_tensor", job.proc)
        wait_for_steps(run_dir, int(job.wait_for_line(RESTART_LINE, count=2)[1]) + 1, job.proc)

        engines = engine_pids(job.proc.pid)
        processes += engines.values()
        arm(fault_dir, engines[1], "rpc.generate", "SIGSTOP")
        faults["SIGSTOP, past max_restarts"] = wait_fired(fault_dir, engines[1], "rpc.generate", job.proc)
        code = job.wait(timeout_s=120)
        ended = time.monotonic()
    finally:
        job.kill()
    output = "\n".join(line for _, line in job.lines)

    # Which step each fault hit depends on how fast the test arms it; the restart lines name it.
    metrics = read_metrics(run_dir)
    restarted = [int(m[1]) for _, line in job.lines if (m := RESTART_LINE.search(line))]
    assert code != 0 and len(restarted) == 2 and restarted[0] < restarted[1], output[-3000:]
    failed_at = len(metrics)  # the step the third loss ended
    assert [m["step"] for m in metrics] == list(range(failed_at)), output[-3000:]  # each step once
    assert [m["engine/restarts"] for m in metrics] == [sum(s <= step for s in restarted) for step in range(failed_at)]
    assert all(metrics[s]["engine/restart_s"] > 0 for s in restarted)
    assert all(m["train/logprob_gap"] < 1e-4 for m in metrics), [m["train/logprob_gap"] for m in metrics]
    assert not any(alive(pid) for pid in processes), [p for p in processes if alive(p)]

    first = job.first_line_after(faults["kill -9 mid-rollout"], "lost in")
    second = job.first_line_after(faults["kill -9 mid-sync"], "lost in")
    assert first and "engine of rank 1 lost in rollout: RpcPeerDiedError" in first[1], first
    assert "exited with code -9 (killed by SIGKILL: " in first[1] and "OOM killer" in first[1], first
    assert second and "engine of rank 0 lost in sync: RpcPeerDiedError" in second[1], second
    assert "update_weights_from_tensor" in second[1], second  # the bucket's error, not the session's end
    final = job.first_line_after(faults["SIGSTOP, past max_restarts"], "are used up")
    assert final and "engine.max_restarts (2) are used up" in final[1], output[-3000:]
    assert "engine of rank 1 lost in rollout: RpcUnresponsiveError: generate " in final[1], final[1]
    assert f"(step {failed_at}, " in final[1] and "process state T (stopped by a signal)" in final[1]
    assert (run_dir / "engine-1.restart1.log").exists() and (run_dir / "engine-0.restart1.log").exists()

    start = resolve_start(CheckpointConfig(resume="auto"), run_dir / "checkpoints")
    saved = failed_at - failed_at % 2  # save_interval 2
    assert start is not None and start.name == f"step_{saved:06d}"  # what the next `resume: auto` continues from
    cursor = json.loads((start / "run_state.json").read_text())["sampler"]
    assert cursor["epoch"] * cursor["num_prompts"] + cursor["position"] == saved * 4, cursor  # lost draws undone

    detected = {
        name: round(hit[0] - at, 2)
        for (name, at), hit in zip(faults.items(), (first, second, final), strict=True)
        if hit is not None
    }
    restart_s = {s: metrics[s]["engine/restart_s"] for s in restarted}
    print(
        f"detection (s): {detected}; restart and re-sync (s) by step: {restart_s}; job ended "
        f"{ended - faults['SIGSTOP, past max_restarts']:.1f} s after SIGSTOP"
    )
