"""``rlrun bench step`` on CPU at the tiny shape: the real loop under torchrun, one rank, the embedded engine;
then the same per-rank work at 2 ranks (gloo): weak scaling keeps the work per rank fixed.

References: metrics.jsonl read here (the loop's own record), the fixed-length formula (ranks x) prompts x
samples x new_tokens, the median and ratio definitions. EOS is made near-certain (every word id is an EOS id
in the model's generation config), so full-length responses show that ``ignore_eos`` reached the engine. The
2-rank run is checked against its own files (config, metrics.jsonl, one engine log per rank) and efficiency =
t(1)/t(N) is recomputed here from the two runs' medians (scripts/gpu/summarise_multi_gpu.py computes it for the
device script). The 1-rank CLI run serves both tests (one module fixture).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlrun.tools.bench.step import StepSettings, Variant, bench_step, prepare_inputs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PHASES = {"offload", "rollout", "memory", "scatter", "logprobs", "train", "sync"}


SETTINGS = StepSettings(shape="tiny", prompts=2, samples=4, prompt_len=8, new_tokens=6, steps=3, micro_batch_samples=4)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The 1-rank ``rlrun bench step`` CLI run: (the process, its work dir, its --out JSON)."""
    tmp_path = tmp_path_factory.mktemp("bench_step")
    work = tmp_path / "work"
    model_dir = prepare_inputs(SETTINGS, work, "float32", "cpu") / "model"
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
    return proc, work, out


def test_bench_step_json_matches_the_loop_metrics(one_rank):
    proc, work, out = one_rank
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
        assert step["wall_s"] == row["time/wall_step_s"] >= step["step_s"] - 1e-3  # the phases lie inside the wall
        assert step["tokens_per_s"] == pytest.approx(step["output_tokens"] / step["step_s"])
        assert step["rollout_tokens_per_s"] == pytest.approx(step["output_tokens"] / row["time/rollout_s"])
        # the offload breakdown: on CPU the engine's release/resume RPCs (the trainer has nothing to move)
        assert step["offload"] == {k[len("offload/") :]: v for k, v in row.items() if k.startswith("offload/")}
        kv = {"engine_resume_kv_s"} if step["step"] > 0 else set()  # no KV cache to resume before the first rollout
        assert set(step["offload"]) == {"engine_release_s", "engine_resume_weights_s"} | kv
        assert 0 < sum(step["offload"].values()) <= step["phases_s"]["offload"]
        assert step["profiled"] is (step["step"] == 1)
        assert step["logprob_gap"] == row["train/logprob_gap"] < 1e-4  # the engine's samples, scored on CPU in fp32
    assert result["max_logprob_gap"] == max(row["train/logprob_gap"] for row in rows)
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


def load_summariser():
    spec = importlib.util.spec_from_file_location("summarise_multi_gpu", REPO / "scripts/gpu/summarise_multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_two_ranks_run_twice_the_prompts_with_the_same_work_per_rank(one_rank, tmp_path, monkeypatch):
    proc, _, out = one_rank
    assert proc.returncode == 0, proc.stderr[-4000:]
    (one,) = json.loads(out.read_text())["results"]  # dataclasses.asdict of the 1-rank BenchResult
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    two = bench_step(dataclasses.replace(SETTINGS, prompts=2 * 2), tmp_path, timeout_s=400, ranks=2)

    assert (one["ranks"], two.ranks) == (1, 2) and one["samples_per_rank"] == two.samples_per_rank == 2 * 4
    run_dir = Path(two.run_dir)
    assert run_dir.name == "embedded_ranks2" and Path(one["run_dir"]).name == "embedded"
    assert sorted(p.name for p in run_dir.glob("engine-*.log")) == ["engine-0.log", "engine-1.log"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rollout"]["prompts_per_step"] == 2 * 2 and config["parallel"]["tp"] == 1
    assert len((tmp_path / "inputs" / "prompts.jsonl").read_text().splitlines()) == 2 * 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/prompts_drawn"] for r in rows] == [4.0] * 3
    assert two.fixed_length and [s.output_tokens for s in two.steps] == [2 * 2 * 4 * 6] * 3

    summary = load_summariser().scaling([dataclasses.asdict(two), one])
    assert [r["ranks"] for r in summary["runs"]] == [1, 2]
    assert summary["runs"][1]["efficiency"] == pytest.approx(one["median_step_s"] / two.median_step_s)
    assert summary["runs"][0]["efficiency"] == 1.0
    with pytest.raises(SystemExit, match="samples per rank"):
        load_summariser().scaling([one, {**dataclasses.asdict(two), "samples_per_rank": 16}])
    with pytest.raises(ValueError, match="must be a multiple of ranks"):
        bench_step(dataclasses.replace(SETTINGS, prompts=3), tmp_path / "odd", ranks=2)
