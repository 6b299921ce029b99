"""The real SmolLM2-135M-Instruct in bf16, colocated with offload, on one GPU (configs/gpu/smollm2_bf16_colocate.yaml):
the on-policy gate is on at 1e-6, so the run only finishes if every step's trainer-vs-engine gap is within it and
step 0's policy ratio is exactly 1. Also on prompts of mixed lengths, which the engine pads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / ".cache/models/SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("data", "attention"),
    [("addition_train", "auto"), ("addition_mixed_len", "auto"), ("addition_mixed_len", "efficient_varlen")],
)
def test_smollm2_bf16_colocated_run_is_on_policy(tmp_path, data, attention):
    """``auto``: the trainer and the engine on the chunked kernels, the engine's decode split over thread blocks;
    ``efficient_varlen``: both on the memory-efficient kernel."""
    if not (MODEL / "config.json").exists():
        pytest.skip("run `python -m rlrun prepare smollm2` first")
    run_dir = tmp_path / "run"
    overrides = [f"logging.run_dir={run_dir}", "train.num_steps=4", f"data.path=configs/data/{data}.jsonl"]
    overrides.append(f"model.packed_attention={attention}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "rlrun"]
    cmd += ["train", "configs/gpu/smollm2_bf16_colocate.yaml", *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/logprob_gap" in r]
    assert trained and all(r["train/logprob_gap"] <= 1e-6 for r in trained)
