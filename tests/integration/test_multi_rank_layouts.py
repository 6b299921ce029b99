"""Multi-GPU layouts on CPU: scripts/gpu/multi_gpu.sh (the device script) in its gloo mode with the tiny shape.

`rlrun train` under torchrun, 3 colocated GRPO steps with offload on: a TP=1 DP=1 baseline on one rank
saves its samples; TP=2, DP=2 and PP=2 on two ranks train on them (same data, same seed), so their
step-0 loss (with an entropy bonus, so it depends on the model's numerics), entropy and gradient norm
must equal the baseline's, and so must the later steps' losses (the optimizer updates agree too). A
trainer TP=2 run with engine.tp=2 (one engine for both ranks, the fake SGLang: the script's
engine_tp2_sglang step) must serve the synced weights: its log-prob gap after each sync stays at fp32
round-off. The reference is the baseline's own metrics.jsonl, read here; the script's summary must agree
with it. The script's engine_tp2 step (the same with the embedded engine) is not run here: its CPU run is
tests/integration/test_engine_group.py::test_cli_run_with_trainer_and_engine_tp_2 (trainer TP=2, engine.tp=2,
colocated with offload on, one engine log, the gap checked after each sync).

Six launches of 2 ranks (about two minutes on 2 cores), so it is marked e2e and runs in CI's second stage. The
main suite keeps a fast check of each thing it shows: TP=2, DP=2 and PP=2 against one rank in process
(test_megatron_train.py), a PP=2 CLI run (test_train_loop.py), a TP=2 CLI run with engine.tp=2 and offload on
(test_engine_group.py), training on loaded samples (test_rollout_cli.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"tp2": (2, 1), "dp2": (1, 1), "pp2": (1, 2)}  # name: (tp, pp) on 2 ranks
REL = 1e-5


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rel_diff(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def test_layouts_match_the_one_rank_baseline(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    env = {**os.environ, "RLRUN_MULTI_GPU_CPU": "1", "RLRUN_MULTI_GPU_RUNS": str(runs), "OUT": str(out)}
    steps = ["prepare", "baseline", *LAYOUTS, "engine_tp2_sglang", "summary"]
    proc = subprocess.run(
        ["bash", "scripts/gpu/multi_gpu.sh", *steps], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    results = (out / "steps.txt").read_text().split("\n")
    assert [line.split()[:2] for line in results if line] == [[s, "rc=0"] for s in steps], proc.stdout[-4000:]

    baseline = rows(runs / "baseline")
    assert [r["step"] for r in baseline] == [0, 1, 2]
    assert baseline[0]["train/loss"] < -1e-3 and baseline[0]["train/grad_norm"] > 1e-3  # not a trivial zero
    assert len({round(r["train/grad_norm"], 6) for r in baseline}) == 3  # the steps saw different data
    summary = json.loads((out / "multi_gpu_layouts.json").read_text())
    for name, (tp, pp) in LAYOUTS.items():
        config = yaml.safe_load((runs / name / "config.yaml").read_text())
        assert (config["parallel"]["tp"], config["parallel"]["pp"]) == (tp, pp)
        assert config["offload"]["train"] and config["offload"]["rollout"]
        assert sorted(p.name for p in (runs / name).glob("engine-*.log")) == ["engine-0.log", "engine-1.log"]
        layout = rows(runs / name)
        assert [r["step"] for r in layout] == [0, 1, 2]
        for key in ("train/loss", "train/entropy", "train/grad_norm"):
            assert rel_diff(layout[0][key], baseline[0][key]) < REL, (name, key, layout[0][key], baseline[0][key])
        for got, want in zip(layout, baseline, strict=False):
            assert (
                got["rollout/loaded_from_disk"] == 1.0 and got["train/num_loss_tokens"] == want["train/num_loss_tokens"]
            )
            assert rel_diff(got["train/loss"], want["train/loss"]) < 10 * REL, (name, got["step"])
            assert got["train/logprob_gap"] < 1e-5  # the baseline engine's log-probs, this layout's trainer
        assert summary["layouts"][name]["ok"] is True and summary["layouts"][name]["ranks"] == 2
        assert summary["layouts"][name]["train/loss"]["baseline"] == baseline[0]["train/loss"]

    name = "engine_tp2_sglang"  # the fake SGLang, 0.5.17
    engine = rows(runs / name)
    assert [r["step"] for r in engine] == [0, 1, 2]
    assert all(r["train/logprob_gap"] < 1e-4 for r in engine), (name, [r["train/logprob_gap"] for r in engine])
    assert sorted(p.name for p in (runs / name).glob("engine-*.log")) == ["engine-0.log"]
    assert summary[name]["ok"] is True and (summary[name]["engine_tp"], summary[name]["backend"]) == (2, "sglang")
    assert "engine_tp2" not in summary  # an engine run that did not run is only listed as not run
    not_run = {"tp2dp2", "tp2pp2", "tp2pp2dp2", "engine_tp2"}
    assert summary["dtype"] == "float32" and set(summary["not_run"]) == not_run
