"""The whole loop through the real CLI under torchrun: 2 ranks, embedded engines over ZMQ, Megatron
on gloo. Asserts on metrics.jsonl: every step logged, the engine and trainer agree on log-probs, and
the reward rises on a task the tiny model can learn. A qwen2 TP=2 CLI run and its log-prob gap after each
sync: tests/integration/test_engine_group.py::test_cli_run_with_trainer_and_engine_tp_2."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def run_train(model_dir: Path, run_dir: Path, *overrides: str, nproc: int = 2, timeout_s: int = 600) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "rlrun",
        "train",
        str(REPO / "configs/quickstart.yaml"),
        "--set",
        f"model.path={model_dir}",
        "--set",
        f"logging.run_dir={run_dir}",
        "--set",
        f"rollout.reward={REPO / 'tests/fixtures/rewards.py'}:digit_fraction",
        "--set",
        "rollout.max_new_tokens=6",
        "--set",
        "rollout.samples_per_prompt=8",
        "--set",
        "optimizer.lr=3e-3",
        *[a for o in overrides for a in ("--set", o)],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(values):
    return sum(values) / len(values)


def test_reward_rises_with_two_dp_ranks(tiny_model_dirs, tmp_path):
    """Also the CLI run of an engine group (engine.tp=2: both DP ranks share rank 0's engine, so rank 1 trains
    on samples from rank 0's engine; tests/integration/test_engine_group.py checks the group itself)."""
    records = run_train(tiny_model_dirs["qwen3"], tmp_path / "run", "train.num_steps=16", "engine.tp=2")
    assert [r["step"] for r in records] == list(range(16))
    for r in records:
        assert r["train/logprob_gap"] < 1e-4, r  # rank 1's samples too, though they came from rank 0's engine
        assert r["time/rollout_s"] > 0 and r["time/sync_s"] > 0
        # Each of the 4 prompts drawn came back as exactly one group: none lost (a second round), none twice.
        assert (r["rollout/prompts_drawn"], r["rollout/sampling_rounds"], r["rollout/surplus_groups"]) == (4, 1, 0), r
    assert sorted(p.name for p in (tmp_path / "run").glob("engine-*.log")) == ["engine-0.log"]
    rewards = [r["rollout/reward_mean"] for r in records]
    assert mean(rewards[-4:]) > mean(rewards[:4]) + 0.05, rewards


def test_pipeline_parallel_run(tiny_model_dirs, tmp_path):
    """PP=2 on the tied-embedding model: one layer per stage, the 1F1B schedule over packed micro-batches
    (thd hidden states cross the stage boundary), and a weight sync that brings both stages' weights to
    each rank's engine (step 1's log-prob gap checks the synced weights)."""
    records = run_train(tiny_model_dirs["llama"], tmp_path / "run", "train.num_steps=2", "parallel.pp=2")
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
        assert r["train/logprob_gap"] < 1e-4, r
