"""configs/quickstart_moe.yaml through the real CLI (torchrun, 2 ranks) on the tiny random Qwen3-MoE:
the engine records routing, the trainer replays it (routing_replay: rollout) for a few steps."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_moe_runs_with_rollout_routing_replay(tmp_path):
    model_dir = make_tiny_model("qwen3_moe", tmp_path / "moe", seed=2)
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "rlrun",
        "train",
        str(REPO / "configs/quickstart_moe.yaml"),
        "--set",
        f"model.path={model_dir}",
        "--set",
        f"logging.run_dir={run_dir}",
        "--set",
        "train.num_steps=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]), r
        # same weights and the engine's routing replayed: engine and trainer log-probs agree closely
        assert r["train/logprob_gap"] < 1e-3, r
