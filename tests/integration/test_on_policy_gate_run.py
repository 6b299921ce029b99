"""The on-policy gate in a real run (one rank, tiny model, CPU): an engine whose final norm weight is perturbed
after loading (tests/fixtures/perturb_engine/sitecustomize.py) samples off-policy at step 0, and the run stops
there with the message; the same run with the engine as loaded and top-p sampling (mask replay) passes the
gate, step-0 ratio check included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from integration.test_train_loop import REPO

pytestmark = pytest.mark.slow


def train(model_dir, run_dir, perturb: bool, **extra) -> subprocess.CompletedProcess:
    overrides = {
        "model.path": model_dir,
        "logging.run_dir": run_dir,
        "rollout.reward": f"{REPO / 'tests/fixtures/rewards.py'}:digit_fraction",
        "rollout.max_new_tokens": 6,
        "rollout.prompts_per_step": 2,
        "train.num_steps": 2,
        "algorithm.max_logprob_gap": 1e-5,
        "algorithm.skip_tied_groups": "false",
        **extra,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "rlrun"]
    cmd += ["train", str(REPO / "configs/quickstart.yaml")]
    cmd += [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": f"{REPO / 'tests/fixtures/perturb_engine'}{os.pathsep}{REPO}",
        "RLRUN_TEST_PERTURB_ENGINE": "1" if perturb else "0",
    }
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_perturbed_engine_weight_trips_the_gate(tiny_model_dirs, tmp_path):
    proc = train(tiny_model_dirs["llama"], tmp_path / "perturbed", perturb=True)
    assert proc.returncode != 0
    assert (
        "train/logprob_gap at step 0 (" in proc.stderr and "must be <= algorithm.max_logprob_gap (1e-05)" in proc.stderr
    )


def test_engine_as_loaded_passes_the_gate_with_top_p_through_mask_replay(tiny_model_dirs, tmp_path):
    """The same run with the engine as loaded passes the gate, with top_p < 1: the engine's log-probs are the
    filtered distribution's; the trainer replays the kept sets, so the gap stays at rounding (without replay
    it would be the log of the kept mass, ~0.1-1). (top_p = 1, no replay, is every other CLI run's gap check.)"""
    proc = train(tiny_model_dirs["llama"], tmp_path / "top_p", perturb=False, **{"rollout.top_p": 0.7})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "top_p/metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "train/logprob_gap" in r)
    assert first["step"] == 0 and first["train/abs_log_ratio"] == 0.0 and first["train/approx_kl"] == 0.0
    gaps = [r["train/logprob_gap"] for r in records if "train/logprob_gap" in r]
    assert gaps and max(gaps) <= 1e-5
