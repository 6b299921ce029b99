"""``rlrun bench step`` at 2 ranks on CPU (gloo, tiny shape): weak scaling keeps the work per rank fixed.

References: the run's own files (config, metrics.jsonl, one engine log per rank), the fixed-length formula
ranks x prompts x samples x new_tokens, and efficiency = t(1)/t(N) recomputed here from the two runs'
medians (scripts/gpu/summarise_multi_gpu.py computes it for the device script).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from rlrun.bench.step import StepSettings, bench_step

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def load_summariser():
    spec = importlib.util.spec_from_file_location("summarise_multi_gpu", REPO / "scripts/gpu/summarise_multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_two_ranks_run_twice_the_prompts_with_the_same_work_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    settings = StepSettings(
        shape="tiny", prompts=2, samples=4, prompt_len=8, new_tokens=6, steps=3, micro_batch_samples=4
    )
    one = bench_step(settings, tmp_path, timeout_s=400)
    two = bench_step(dataclasses.replace(settings, prompts=2 * 2), tmp_path, timeout_s=400, ranks=2)

    assert (one.ranks, two.ranks) == (1, 2) and one.samples_per_rank == two.samples_per_rank == 2 * 4
    run_dir = Path(two.run_dir)
    assert run_dir.name == "embedded_ranks2" and Path(one.run_dir).name == "embedded"
    assert sorted(p.name for p in run_dir.glob("engine-*.log")) == ["engine-0.log", "engine-1.log"]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["rollout"]["prompts_per_step"] == 2 * 2 and config["parallel"]["tp"] == 1
    assert len((tmp_path / "inputs" / "prompts.jsonl").read_text().splitlines()) == 2 * 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/prompts_drawn"] for r in rows] == [4.0] * 3
    assert two.fixed_length and [s.output_tokens for s in two.steps] == [2 * 2 * 4 * 6] * 3

    summary = load_summariser().scaling([dataclasses.asdict(two), dataclasses.asdict(one)])
    assert [r["ranks"] for r in summary["runs"]] == [1, 2]
    assert summary["runs"][1]["efficiency"] == pytest.approx(one.median_step_s / two.median_step_s)
    assert summary["runs"][0]["efficiency"] == 1.0
    with pytest.raises(SystemExit, match="samples per rank"):
        load_summariser().scaling([dataclasses.asdict(one), {**dataclasses.asdict(two), "samples_per_rank": 16}])
    with pytest.raises(ValueError, match="must be a multiple of ranks"):
        bench_step(dataclasses.replace(settings, prompts=3), tmp_path / "odd", ranks=2)
