"""Bounded-staleness asynchronous RL (``rollout.max_staleness``) through the real CLI under torchrun: 2 ranks,
embedded engines over ZMQ, Megatron on gloo. Asserts on metrics.jsonl: every sample's age in weight versions,
the trainer's KL to the sampling policy, and an exact resume with rollouts in flight."""

from __future__ import annotations

import json
import math

import pytest

from integration.test_resume import comparable, read_metrics, run_to_end, run_until_sigterm

pytestmark = pytest.mark.slow

ASYNC = ("rollout.max_staleness=1", "algorithm.max_logprob_gap=null")


def test_max_staleness_1_trains_one_version_behind(tiny_model_dirs, tmp_path):
    """Step 0 trains on the initial weights' samples (0 behind); from step 1 on every sample was generated
    while the previous step trained, so it is exactly one version behind, and the trainer's log-probs differ
    from the sampling policy's by that update (the KL is no kernel-level difference any more)."""
    run_to_end(tiny_model_dirs["qwen3"], tmp_path / "run", "train.num_steps=5", *ASYNC)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(5))
    assert records[0]["rollout/versions_behind_max"] == 0
    assert records[0]["train/logprob_gap"] < 1e-4  # the same weights on both sides at step 0
    for r in records[1:]:
        assert r["rollout/versions_behind_mean"] == 1 and r["rollout/versions_behind_max"] == 1, r
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
        assert r["train/mismatch_k3"] > 1e-6, r  # lr 3e-3: one update moves the policy measurably


def test_resume_with_rollouts_in_flight_matches_uninterrupted_run(tiny_model_dirs, tmp_path):
    """SIGTERM with a rollout generated ahead: the checkpoint holds that batch and the sampler cursor past its
    prompts; the resumed run trains it first and every step's metrics equal the uninterrupted run's."""
    model = tiny_model_dirs["qwen3"]
    run_to_end(model, tmp_path / "straight", "train.num_steps=6", *ASYNC)
    reference = read_metrics(tmp_path / "straight")

    run_dir = tmp_path / "interrupted"
    output = run_until_sigterm(model, run_dir, 2, "train.num_steps=6", *ASYNC)
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "COMPLETE").is_file(), output[-5000:]
    stopped_at = json.loads((checkpoints[0] / "run_state.json").read_text())["step"]
    assert 2 <= stopped_at < 6, output[-5000:]
    assert (checkpoints[0] / "rollout_carry.pt").is_file()  # the batch generated ahead

    run_to_end(model, run_dir, "train.num_steps=6", "checkpoint.resume=auto", *ASYNC)
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(6))
    for got, want in zip(resumed, reference, strict=True):
        assert comparable(got) == comparable(want), f"step {want['step']} differs after resuming at {stopped_at}"
