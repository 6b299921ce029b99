"""``rlrun bench step`` on CPU at the tiny shape: the real loop under torchrun, one rank, the embedded engine.

References: metrics.jsonl read here (the loop's own record), the fixed-length formula prompts x samples x
new_tokens, the median and ratio definitions. EOS is made near-certain (every word id is an EOS id in the
model's generation config), so full-length responses show that ``ignore_eos`` reached the engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from rlrun.bench.step import StepSettings, Variant, prepare_inputs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PHASES = {"offload", "rollout", "memory", "scatter", "logprobs", "train", "sync"}


def test_bench_step_json_matches_the_loop_metrics(tmp_path):
    settings = StepSettings(
        shape="tiny", prompts=2, samples=4, prompt_len=8, new_tokens=6, steps=3, micro_batch_samples=4
    )
    work = tmp_path / "work"
    model_dir = prepare_inputs(settings, work, "float32", "cpu") / "model"
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = list(range(1, 512))  # any sampled word would stop a response at once
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    out = tmp_path / "step.json"
    cmd = [
        sys.executable,
        "-m",
        "rlrun",
        "bench",
        "step",
        "--shape",
        "tiny",
        "--prompts",
        "2",
        "--samples",
        "4",
        "--prompt-len",
        "8",
        "--new-tokens",
        "6",
        "--steps",
        "3",
        "--micro-batch-samples",
        "4",
        "--work",
        str(work),
        "--out",
        str(out),
        "--timeout-s",
        "400",
        "--profile-step",
        "1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    record = json.loads(out.read_text())
    assert record["benchmark"] == "step" and record["command"].startswith("rlrun bench step --shape tiny")
    assert record["date_utc"] and record["torch"] and record["transformers"]
    (result,) = record["results"]
    assert result["settings"]["backend"] == "embedded" and result["hardware"] == "cpu"
    assert "megatron-core" in result["versions"] and result["dtype"] == "float32"
    assert json.loads((work / "inputs" / "model" / "generation_config.json").read_text())["eos_token_id"][0] == 1

    rows = [json.loads(line) for line in (work / "embedded" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in result["steps"]] == [r["step"] for r in rows] == [0, 1, 2]
    for step, row in zip(result["steps"], rows, strict=False):
        assert row["rollout/response_len_mean"] == 6 and row["rollout/truncated_frac"] == 1.0
        assert step["output_tokens"] == 2 * 4 * 6
        assert set(step["phases_s"]) == PHASES
        assert sum(step["phases_s"].values()) == pytest.approx(step["step_s"], abs=1e-3)
        assert step["step_s"] == row["time/step_s"] and step["phases_s"]["train"] == row["time/train_s"]
        assert step["tokens_per_s"] == pytest.approx(step["output_tokens"] / step["step_s"])
        assert step["rollout_tokens_per_s"] == pytest.approx(step["output_tokens"] / row["time/rollout_s"])
        # the offload breakdown: on CPU the engine's release/resume RPCs (the trainer has nothing to move)
        assert step["offload"] == {k[len("offload/") :]: v for k, v in row.items() if k.startswith("offload/")}
        kv = {"engine_resume_kv_s"} if step["step"] > 0 else set()  # no KV cache to resume before the first rollout
        assert set(step["offload"]) == {"engine_release_s", "engine_resume_weights_s"} | kv
        assert 0 < sum(step["offload"].values()) <= step["phases_s"]["offload"]
        assert step["profiled"] is (step["step"] == 1)
    assert result["fixed_length"] is True and result["warmup_steps"] == 2
    assert result["variant"] == dataclasses.asdict(Variant())  # the defaults: offload on, nothing else changed
    assert result["label"] == "embedded"

    # step 1's train phase, from the profiler's trace: its range lasts as long as the loop timed the phase
    profile = result["profile"]
    assert (profile["phase"], profile["step"]) == ("train", 1) and Path(profile["trace"]).exists()
    assert profile["phase_us"] / 1e6 == pytest.approx(rows[1]["time/train_s"], rel=0.05, abs=0.02)
    assert 0 < len(profile["ops"]) <= 25 and any(op["name"].startswith("aten::") for op in profile["ops"])
    assert all(0 < op["cpu_self_us"] <= op["cpu_total_us"] <= profile["phase_us"] for op in profile["ops"])
    timed = result["steps"][2:]  # after warm-up (the profiled step 1 is in it)
    assert result["median_step_s"] == pytest.approx(statistics.median(s["step_s"] for s in timed))
    for phase in PHASES:
        assert result["median_phases_s"][phase] == pytest.approx(statistics.median(s["phases_s"][phase] for s in timed))
    assert result["median_tokens_per_s"] == pytest.approx(statistics.median(s["tokens_per_s"] for s in timed))
