"""Bounded-staleness asynchronous RL (``rollout.max_staleness``) through the real CLI under torchrun: 2 ranks,
embedded engines over ZMQ, Megatron on gloo. Asserts on metrics.jsonl: every sample's age in weight versions,
the trainer's KL to the sampling policy, rollouts continued across a weight update (K = 2), an exact resume
with rollouts in flight, and an engine worker killed mid-run and restarted (``engine.max_restarts``)."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from integration.test_resume import comparable, read_metrics, run_to_end, run_until_sigterm, train_command, train_env
from rlrun.runtime.fault_points import DIR_ENV

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from faults import Job, arm, wait_fired, wait_for_engine, wait_for_steps  # noqa: E402

pytestmark = pytest.mark.slow

ASYNC = ("rollout.max_staleness=1", "algorithm.max_logprob_gap=null")
CONTINUED = ("rollout.max_staleness=2", "rollout.continue_after_tokens=3", "algorithm.max_logprob_gap=null")
SETTINGS = {"k1": ASYNC, "k2_continued": CONTINUED}


@pytest.fixture(scope="module")
def straight_runs(tiny_model_dirs, tmp_path_factory) -> Callable[[str], Path]:
    """The run directory of one uninterrupted 6-step run per name of ``SETTINGS``, run on first use:
    the staleness tests assert on it and the resume tests compare against it, so each is run once."""
    runs: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in runs:
            run_dir = tmp_path_factory.mktemp("straight") / name
            run_to_end(tiny_model_dirs["qwen3"], run_dir, "train.num_steps=6", *SETTINGS[name])
            runs[name] = run_dir
        return runs[name]

    return run


def test_max_staleness_1_trains_one_version_behind(straight_runs):
    """Step 0 trains on the initial weights' samples (0 behind); from step 1 on every sample was generated
    while the previous step trained, so it is exactly one version behind, and the trainer's log-probs differ
    from the sampling policy's by that update (the KL is no kernel-level difference any more)."""
    records = read_metrics(straight_runs("k1"))
    assert [r["step"] for r in records] == list(range(6))
    assert records[0]["rollout/versions_behind_max"] == 0
    assert records[0]["train/logprob_gap"] < 1e-4  # the same weights on both sides at step 0
    for r in records[1:]:
        assert r["rollout/versions_behind_mean"] == 1 and r["rollout/versions_behind_max"] == 1, r
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
        assert r["train/mismatch_k3"] > 1e-6, r  # lr 3e-3: one update moves the policy measurably


def test_max_staleness_2_continues_long_samples_under_the_newer_weights(straight_runs):
    """K = 2 with continuation, max_new_tokens 6: step m's first 3 tokens of every sample come from the weights
    trained through step m-3 (2 versions behind the trainer), the rest of a longer response from those trained
    through step m-2 (1 behind). So from step 2 on the oldest token is 2 behind and a sample's mean is between
    1.5 (6 tokens: 3 + 3) and 2 (3 tokens or fewer); step 1 samples wholly with the initial weights."""
    records = read_metrics(straight_runs("k2_continued"))
    assert [r["step"] for r in records] == list(range(6))
    assert records[0]["rollout/versions_behind_max"] == 0
    assert records[1]["rollout/versions_behind_mean"] == 1 and records[1]["rollout/versions_behind_max"] == 1
    for r in records[2:]:
        assert r["rollout/versions_behind_max"] == 2, r
        assert 1.5 <= r["rollout/versions_behind_mean"] <= 2, r
        assert math.isfinite(r["train/loss"]) and r["train/mismatch_k3"] > 1e-6, r
    assert any(r["rollout/versions_behind_mean"] < 2 for r in records[2:]), "no sample crossed the boundary"


@pytest.mark.parametrize("name", SETTINGS)
def test_resume_with_rollouts_in_flight_matches_uninterrupted_run(tiny_model_dirs, straight_runs, tmp_path, name):
    """SIGTERM with rollouts generated ahead: the checkpoint holds those batches (with K = 2 and continuation,
    samples whose tokens span two versions) and the sampler cursor past their prompts; the resumed run trains
    them first and every step's metrics equal the uninterrupted run's."""
    model, settings = tiny_model_dirs["qwen3"], SETTINGS[name]
    reference = read_metrics(straight_runs(name))

    run_dir = tmp_path / "interrupted"
    output = run_until_sigterm(model, run_dir, 2, "train.num_steps=6", *settings)
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "COMPLETE").is_file(), output[-5000:]
    stopped_at = json.loads((checkpoints[0] / "run_state.json").read_text())["step"]
    assert 2 <= stopped_at < 6, output[-5000:]
    carry = torch.load(checkpoints[0] / "rollout_carry.pt", weights_only=True)  # the batches generated ahead
    max_staleness = 2 if settings is CONTINUED else 1
    assert [row["step"] for row in carry] == list(range(stopped_at, min(stopped_at + max_staleness, 6)))
    if settings is CONTINUED:  # samples whose tokens came from two versions travel with their spans
        assert any(sample["weight_spans"] for row in carry for sample in row["samples"])

    run_to_end(model, run_dir, "train.num_steps=6", "checkpoint.resume=auto", *settings)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(6))
    for got, want in zip(resumed, reference, strict=True):
        assert comparable(got) == comparable(want), f"step {want['step']} differs after resuming at {stopped_at}"


RESTART_LINE = re.compile(r"\[rlrun\] rank 0: restarting the engine of rank\(s\) \[1\] at step (\d+) \(rollout ahead;")


def kill_engine(model: Path, run_dir: Path, point: str, settings: list[str], times: int = 1) -> tuple[int, str]:
    """Run with ``settings``; once step 1 is logged, SIGKILL rank 1's engine worker at its next ``point`` (a fault
    point: it lands in that request, on the rollout thread), ``times`` times (each restarted worker at its next
    ``rpc.generate``); the job's exit code and output. A push is armed as soon as the worker exists: it carries
    trained weights, so none comes before step 0 has trained, and one that follows step 0 by milliseconds is
    not missed by a test process that polls late."""
    fault_dir = run_dir.with_name(run_dir.name + "-faults")
    fault_dir.mkdir()
    job = Job(train_command(model, run_dir, *settings), {**train_env(), DIR_ENV: str(fault_dir)})
    try:
        killed: list[int] = []
        for n in range(times):
            worker = wait_for_engine(job.proc.pid, 1, job.proc, tuple(killed))
            if n == 0 and point != "rpc.update_weights_from_tensor":
                wait_for_steps(run_dir, 1, job.proc, timeout_s=300)
            arm(fault_dir, worker, point if n == 0 else "rpc.generate", "SIGKILL")
            wait_fired(fault_dir, worker, point if n == 0 else "rpc.generate", job.proc)
            killed.append(worker)
            if n + 1 < times:
                job.wait_for_line(RESTART_LINE, count=n + 1)
        code = job.wait(timeout_s=300)
    finally:
        job.kill()
    return code, "\n".join(line for _, line in job.lines)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("settings", "point"),
    [(ASYNC, "rpc.generate"), (ASYNC, "rpc.update_weights_from_tensor"), (CONTINUED, "rpc.generate")],
    ids=["k1_generate", "k1_push", "k2_continued_generate"],
)
def test_engine_killed_with_rollouts_ahead_restarts_and_matches_uninterrupted_run(
    tiny_model_dirs, tmp_path, settings, point
):
    """``engine.max_restarts: 1``: rank 1's engine worker is SIGKILLed as a rollout's generate (or the push of
    published weights before one) arrives on the rollout thread; with K = 2 and continuation the generate may be
    a continued segment's. The engine is restarted, loads the weights that rollout was given and the rollout is
    redone with the same prompts and seeds: every step is logged once, the restart counted from the step that
    waited for the lost rollout, and every other metric equals an uninterrupted run's."""
    model, num_steps = tiny_model_dirs["qwen3"], 5
    settings = [f"train.num_steps={num_steps}", "engine.max_restarts=1", *settings]
    run_to_end(model, tmp_path / "reference", *settings)
    reference = read_metrics(tmp_path / "reference")
    code, output = kill_engine(model, tmp_path / "killed", point, settings)
    assert code == 0, output[-5000:]
    restarted = RESTART_LINE.search(output)
    assert restarted, output[-5000:]
    step = int(restarted[1])
    assert (tmp_path / "killed" / "engine-1.restart1.log").exists()
    lost_in = "rollout" if point == "rpc.generate" else "sync"
    assert f"engine of rank 1 lost in {lost_in}: RpcPeerDiedError" in output, output[-5000:]
    metrics = read_metrics(tmp_path / "killed")
    assert [m["step"] for m in metrics] == list(range(num_steps)), output[-5000:]
    assert 2 <= step < num_steps
    assert [m["engine/restarts"] for m in metrics] == [float(s >= step) for s in range(num_steps)]
    assert metrics[step]["engine/restart_s"] > 0
    for got, want in zip(metrics, reference, strict=True):
        got, want = ({k: v for k, v in r.items() if not k.startswith(("time/", "engine/"))} for r in (got, want))
        assert got.keys() == want.keys(), got.keys() ^ want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (got["step"], key, got[key], value)


@pytest.mark.e2e
def test_engine_lost_past_max_restarts_with_rollouts_ahead_ends_the_job(tiny_model_dirs, tmp_path):
    """K = 1, ``engine.max_restarts: 1``: the worker killed again after its restart ends the job with the cause."""
    settings = ["train.num_steps=8", "engine.max_restarts=1", *ASYNC]
    code, output = kill_engine(tiny_model_dirs["qwen3"], tmp_path / "run", "rpc.generate", settings, times=2)
    assert code != 0, output[-5000:]
    final = [line for line in output.splitlines() if "are used up" in line]
    assert final and "engine.max_restarts (1) are used up" in final[0], output[-5000:]
    assert "engine of rank 1 lost in rollout: RpcPeerDiedError" in final[0], final[0]
    assert len(read_metrics(tmp_path / "run")) < 8
