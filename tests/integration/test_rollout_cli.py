"""Rollout features through the real CLI under torchrun (tiny model, embedded engines, Megatron on gloo):
the calculator-tool example trains with eval and debug dumps; a saved rollout trains without
generating; rollout-only mode never trains; a malformed prompt row stops the run before step 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DIGITS = f"{REPO / 'tests/fixtures/rewards.py'}:digit_fraction"  # a reward the random model gets varied scores on


def torchrun(config: str, model_dir: Path, run_dir: Path, *overrides: str, nproc: int = 1, check: bool = True):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "rlrun",
        "train",
        str(REPO / config),
        "--set",
        f"model.path={model_dir}",
        "--set",
        f"logging.run_dir={run_dir}",
        *[a for o in overrides for a in ("--set", o)],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, (
            f"train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


SMALL = (
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "rollout.over_sampling_prompts=null",
    "rollout.dynamic_filter=null",
    f"rollout.reward={DIGITS}",
)


@pytest.mark.e2e  # the calculator's multi-turn loop is in the main suite: test_rollout_multiturn
def test_calculator_example_with_eval_and_debug_data(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["qwen2"]
    run_a = tmp_path / "a"
    torchrun(
        "configs/calculator_tool.yaml",
        model,
        run_a,
        *SMALL,
        "train.num_steps=2",
        "eval.interval=1",
        "eval.datasets=[{name: calc, path: 'examples/calculator_tool/data/eval.jsonl@[:4]'}]",
        "eval.max_new_tokens=4",
        "debug.save_rollout_data=true",
        "debug.save_train_data=true",
        nproc=2,
    )
    steps = records(run_a)
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert r["train/logprob_gap"] < 1e-4  # trainer and engine agree on every model token of multi-turn samples
        assert 0 <= r["eval/calc/pass@1"] <= r["eval/calc/pass@4"] <= 1 and "eval/calc/reward_mean" in r
    saved = [json.loads(line) for line in (run_a / "debug/rollout_000000.jsonl").read_text().splitlines()]
    assert len(saved) == 8 and all(len(s["loss_mask"]) == len(s["response_ids"]) for s in saved)
    env_tokens = sum(len(s["loss_mask"]) - sum(s["loss_mask"]) for s in saved)
    assert env_tokens > 0, "no tool or nudge turn in 8 trajectories"
    trained = [mb for rank in (0, 1) for mb in torch.load(run_a / f"debug/train_000000_rank{rank}.pt")]
    assert sum(int(mb["loss_mask"].sum()) for mb in trained) == sum(sum(s["loss_mask"]) for s in saved)
    for mb in trained:  # advantages and engine log-probs live exactly on the model's own tokens
        assert torch.equal(mb["advantages"] * mb["loss_mask"], mb["advantages"])
        assert torch.equal(mb["rollout_logprobs"] * mb["loss_mask"], mb["rollout_logprobs"])

    # Train-only from the saved rollouts: same samples, no engine generation.
    run_b = tmp_path / "b"
    torchrun(
        "configs/calculator_tool.yaml",
        model,
        run_b,
        *SMALL,
        "train.num_steps=2",
        f"debug.load_rollout_data={run_a / 'debug'}",
    )
    loaded = records(run_b)
    assert [r["rollout/loaded_from_disk"] for r in loaded] == [1.0, 1.0]
    assert [r["rollout/reward_mean"] for r in loaded] == [r["rollout/reward_mean"] for r in steps]

    # Rollout only: rollout metrics, no training, no weight sync.
    run_c = tmp_path / "c"
    torchrun("configs/calculator_tool.yaml", model, run_c, *SMALL, "train.num_steps=2", "debug.rollout_only=true")
    only = records(run_c)
    assert len(only) == 2 and all("rollout/reward_mean" in r for r in only)
    assert not any(k.startswith("train/") or k == "time/sync_s" for r in only for k in r)


def test_malformed_jsonl_line_stops_before_the_first_step(tiny_model_dirs, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "label": 2}\n\n{"prompt": "What is 2 + 2?", "label": 4\n')
    run_dir = tmp_path / "run"
    proc = torchrun(
        "configs/quickstart.yaml",
        tiny_model_dirs["qwen2"],
        run_dir,
        f"data.path={data}",
        "train.num_steps=2",
        check=False,
    )
    assert proc.returncode != 0
    assert f"{data}:3: invalid JSON (Expecting ',' delimiter at column 40)" in proc.stdout + proc.stderr
    assert records(run_dir) == []  # no step ran
