"""Disaggregated placement (``placement.engine_ranks``) through the real CLI under torchrun: training ranks with
Megatron on gloo, engine ranks with embedded engines over ZMQ, prompts, samples and weights over
torch.distributed. Asserts on metrics.jsonl against a colocated run of the same seed and data, on the
watchdog's line when an engine rank dies, and on every step's row when an engine rank's worker is killed
and restarted (``engine.max_restarts``)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_failure import alive
from test_resume import comparable, read_metrics, run_to_end, run_until_sigterm, train_command, train_env

from rlrun.runtime.fault_points import DIR_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from faults import Job, arm, children, engine_pids, rank_pids, wait_fired, wait_for_engine, wait_for_steps  # noqa: E402

ENGINE_RANK = ("placement.engine_ranks=1",)
ASYNC = ("rollout.max_staleness=1", "algorithm.max_logprob_gap=null")


def command(model_dir: Path, run_dir: Path, num_ranks: int, *overrides: str) -> list[str]:
    """``train_command`` (configs/quickstart.yaml on the tiny model's task) with ``num_ranks`` torchrun ranks."""
    cmd = train_command(model_dir, run_dir, *overrides)
    return [f"--nproc-per-node={num_ranks}" if a == "--nproc-per-node=2" else a for a in cmd]


def run(model_dir: Path, run_dir: Path, num_ranks: int, *overrides: str) -> list[dict]:
    proc = subprocess.run(
        command(model_dir, run_dir, num_ranks, *overrides),
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return read_metrics(run_dir)


def numbers(record: dict) -> dict[str, float]:
    """The step's metrics but wall-clock times and memory (which depend on where things run)."""
    skip = ("time/", "memory/", "perf/", "offload/")
    return {k: v for k, v in record.items() if not k.startswith(skip) and isinstance(v, (int, float))}


@pytest.mark.parametrize(
    ("num_trainers", "num_steps"),
    [
        pytest.param(1, 4, id="1-trainer"),
        pytest.param(2, 3, id="2-trainers"),
    ],
)
def test_one_engine_rank_trains_what_colocated_ranks_train(tiny_model_dirs, tmp_path, num_trainers, num_steps):
    """K = 0, the same seed and data: N training ranks + 1 engine rank against N colocated ranks. The engine
    rank serves every colocated rank's share of each round with that rank's seed, and gets the trainer's
    weights by broadcast after every step, so rewards, losses, gradient norms and log-prob gaps match within
    1e-5 at every step (with 2 training ranks, also the data-parallel split of the train batch)."""
    model, steps = tiny_model_dirs["qwen3"], f"train.num_steps={num_steps}"
    colocated = run(model, tmp_path / "colocated", num_trainers, steps)
    disaggregated = run(model, tmp_path / "disaggregated", num_trainers + 1, steps, *ENGINE_RANK)
    assert_same_run(disaggregated, colocated, num_steps)


def test_engine_groups_of_engine_ranks_train_what_colocated_engine_groups_train(tiny_model_dirs, tmp_path):
    """engine.tp 2, K = 0: 2 training ranks + 2 engine ranks (one engine group, its leader generating both
    training ranks' shares in one call with the first's seed) against 2 colocated ranks forming one engine group
    the same way; every step's metrics match within 1e-5, and the engine ranks' weights are synced every step."""
    model, steps, tp = tiny_model_dirs["qwen3"], "train.num_steps=3", "engine.tp=2"
    colocated = run(model, tmp_path / "colocated", 2, steps, tp)
    disaggregated = run(model, tmp_path / "disaggregated", 4, steps, tp, "placement.engine_ranks=2")
    assert_same_run(disaggregated, colocated, 3)


def assert_same_run(disaggregated: list[dict], colocated: list[dict], num_steps: int) -> None:
    """Every step logged once, and every metric but times and memory equal within 1e-5."""
    assert [r["step"] for r in disaggregated] == list(range(num_steps))
    assert len(colocated) == num_steps
    for got, want in zip(disaggregated, colocated, strict=True):
        got, want = numbers(got), numbers(want)
        assert set(got) == set(want), set(got) ^ set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (got["step"], key, got[key], value)
    # the run learned something that depends on the synced weights: the policy moved between steps
    assert any(r["train/grad_norm"] > 0 for r in colocated)


def test_engine_rank_generates_ahead_one_version_behind(tiny_model_dirs, tmp_path):
    """K = 1: the engine rank generates step n+1 while the trainer trains step n, so from step 1 on every sample
    is exactly one weight version behind, and the trainer's KL to the sampling policy shows the update."""
    records = run(tiny_model_dirs["qwen3"], tmp_path / "run", 2, "train.num_steps=5", *ENGINE_RANK, *ASYNC)
    assert [r["step"] for r in records] == list(range(5))
    assert records[0]["rollout/versions_behind_max"] == 0
    for r in records[1:]:
        assert r["rollout/versions_behind_mean"] == 1 and r["rollout/versions_behind_max"] == 1, r
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
        assert r["train/mismatch_k3"] > 1e-6, r


def test_resume_with_rollouts_in_flight_matches_uninterrupted_run(tiny_model_dirs, tmp_path):
    """K = 1, SIGTERM to the whole job (the engine rank included) with a rollout generated ahead: the trainer
    checkpoints that batch and stops the engine rank; the resumed run re-syncs the engine rank's weights, trains
    the batch first, and every step's metrics equal the uninterrupted run's (2 ranks: 1 training, 1 engine)."""
    model = tiny_model_dirs["qwen3"]
    run_to_end(model, tmp_path / "straight", "train.num_steps=6", *ENGINE_RANK, *ASYNC)
    reference = read_metrics(tmp_path / "straight")

    run_dir = tmp_path / "interrupted"
    output = run_until_sigterm(model, run_dir, 2, "train.num_steps=6", *ENGINE_RANK, *ASYNC)
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "COMPLETE").is_file(), output[-5000:]
    stopped_at = json.loads((checkpoints[0] / "run_state.json").read_text())["step"]
    assert 2 <= stopped_at < 6, output[-5000:]

    run_to_end(model, run_dir, "train.num_steps=6", "checkpoint.resume=auto", *ENGINE_RANK, *ASYNC)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(6))
    for got, want in zip(resumed, reference, strict=True):
        assert comparable(got) == comparable(want), f"step {want['step']} differs after resuming at {stopped_at}"


def test_killed_engine_rank_ends_the_job_naming_it(tiny_model_dirs, tmp_path):
    """SIGKILL the engine rank once training runs: every process of the job is gone within 30 s and the training
    rank's watchdog line names the engine rank and its pid."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        command(tiny_model_dirs["qwen3"], run_dir, 2, "train.num_steps=500", *ENGINE_RANK),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    job: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and read_metrics(run_dir), f"run did not start:\n{proc.stdout.read()[-5000:]}"
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        assert children(ranks[0]) == [] and len(children(ranks[1])) == 1  # the engine worker is rank 1's
        job = [proc.pid, *ranks.values(), *children(ranks[1])]
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        while any(alive(pid) for pid in job) and time.monotonic() - killed_at < 60:
            time.sleep(0.1)
        elapsed = time.monotonic() - killed_at
        assert not any(alive(pid) for pid in job), f"still running after {elapsed:.0f} s"
        assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    finally:
        for pid in job:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    survivor = re.search(r"\[rlrun\] rank 0 \(pid \d+ on [^)]+\) exiting: (.*)", output)
    assert survivor, output[-5000:]
    assert re.match(rf"engine rank 1 \(pid {ranks[1]} on [^)]+\) died", survivor.group(1)), survivor.group(0)


def test_engine_rank_restarts_its_killed_worker_and_the_run_completes(tiny_model_dirs, tmp_path):
    """K = 0, ``engine.max_restarts: 1``: the engine rank's worker is SIGKILLed as a generate (one run) or a weight
    bucket (another) arrives (a fault point, so it lands in that phase). The engine rank starts a fresh worker,
    rank 0 broadcasts the current weights again and, for a rollout, the step is redone: every step is logged
    once, the restart is counted from its step on, both ranks say so, and every metric but the restart's own
    equals a run without the kill's (the on-policy gate, ``algorithm.max_logprob_gap`` 1e-4, held throughout)."""
    model, num_steps = tiny_model_dirs["qwen3"], 5
    settings = [f"train.num_steps={num_steps}", "engine.max_restarts=1", "engine.heartbeat_timeout_s=2", *ENGINE_RANK]
    reference = [numbers(r) for r in run(model, tmp_path / "reference", 2, *settings)]
    for point, phase in [("rpc.generate", "rollout"), ("rpc.update_weights_from_tensor", "sync")]:
        kill_worker_and_check_the_run(model, tmp_path, 2, settings, point, phase, reference)


def test_engine_group_of_engine_ranks_restarts_its_killed_worker(tiny_model_dirs, tmp_path):
    """As above with 1 training rank + 2 engine ranks forming one engine group (engine.tp 2), its worker killed at
    a generate: the leader (rank 1) reports the loss, both ranks of the group restart it (the member takes part
    in the group's collective restart), and the run completes as one without the kill."""
    model, num_steps = tiny_model_dirs["qwen3"], 6  # steps enough that the fault is armed before the last generate
    settings = [
        f"train.num_steps={num_steps}",
        "engine.max_restarts=1",
        "engine.heartbeat_timeout_s=2",
        "engine.tp=2",
        "placement.engine_ranks=2",
    ]
    reference = [numbers(r) for r in run(model, tmp_path / "reference", 3, *settings)]
    kill_worker_and_check_the_run(model, tmp_path, 3, settings, "rpc.generate", "rollout", reference)


def run_with_worker_killed(
    model: Path, run_dir: Path, fault_dir: Path, num_ranks: int, settings: list[str], point: str
) -> tuple[int, str]:
    """Run the job and SIGKILL rank 1's engine worker (the first engine rank's, its group's leader) when it next
    reaches fault point ``point`` after step 0; the job's exit code and output. A push is armed as soon as the
    worker exists: it carries trained weights, so none comes before step 0 has trained, and one that follows
    step 0 by milliseconds is not missed by a test process that polls late."""
    fault_dir.mkdir()
    job = Job(command(model, run_dir, num_ranks, *settings), {**train_env(), DIR_ENV: str(fault_dir)})
    try:
        worker = wait_for_engine(job.proc.pid, 1, job.proc)
        assert list(engine_pids(job.proc.pid)) == [1]  # the engine (group leader) rank's worker; the others have none
        if point != "rpc.update_weights_from_tensor":
            wait_for_steps(run_dir, 1, job.proc, timeout_s=300)
        arm(fault_dir, worker, point, "SIGKILL")
        wait_fired(fault_dir, worker, point, job.proc)
        code = job.wait(timeout_s=300)
    finally:
        job.kill()
    return code, "\n".join(line for _, line in job.lines)


def assert_restart_counted_and_metrics_equal(metrics: list[dict], reference: list[dict], step: int) -> None:
    """Every step logged once, ``engine/restarts`` counted from ``step`` on, every other metric within 1e-5 of the
    run without the kill."""
    assert [m["step"] for m in metrics] == list(range(len(reference)))
    assert [m["engine/restarts"] for m in metrics] == [float(s >= step) for s in range(len(reference))]
    for got, want in zip(metrics, reference, strict=True):
        got = {k: v for k, v in numbers(got).items() if not k.startswith("engine/")}
        want = {k: v for k, v in want.items() if not k.startswith("engine/")}
        assert got.keys() == want.keys(), got.keys() ^ want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (got["step"], key, got[key], value)


def kill_worker_and_check_the_run(
    model: Path, tmp_path: Path, num_ranks: int, settings: list[str], point: str, phase: str, reference: list[dict]
) -> None:
    """Kill the worker at ``point`` (:func:`run_with_worker_killed`) and check the restart's lines, its count and
    every other metric against ``reference``."""
    run_dir = tmp_path / phase
    code, output = run_with_worker_killed(model, run_dir, tmp_path / f"{phase}-faults", num_ranks, settings, point)
    assert code == 0, output[-5000:]
    restarted = re.search(
        r"\[rlrun\] engine rank 0 \(rank 1\): restarting its engine worker at step (\d+): (.*)", output
    )
    assert restarted, output[-5000:]
    step = int(restarted[1])
    assert f"engine of rank 1 lost in {phase}: RpcPeerDiedError" in restarted[2], restarted[0]
    assert re.search(rf"\[rlrun\] rank 0: restarting the engine of rank\(s\) \[1\] at step {step} \({phase};", output)
    assert (run_dir / "engine-1.restart1.log").exists()
    metrics = read_metrics(run_dir)
    assert metrics[step]["engine/restart_s"] > 0
    assert_restart_counted_and_metrics_equal(metrics, reference, step)
    assert any(m.get("train/grad_norm", 0) > 0 for m in metrics[step:])  # weights moved after the restart
