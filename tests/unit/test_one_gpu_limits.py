"""benchmarks/one_gpu_limits.py reads the right value from the right file: the newest reading wins, the exact-MFU row
counts only kernels that are exact with the engine, and the exact path's overhead pairs the two step records one
device call wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import one_gpu_limits  # noqa: E402


def _step_record(label: str, step_s: float, date: str) -> dict:
    result = {
        "label": label,
        "settings": {"shape": "qwen3-0.6b"},
        "median_step_s": step_s,
        "max_logprob_gap": 0.0,
        "median_offload": {},
        "hardware": "NVIDIA H100",
    }
    return {"benchmark": "step", "date_utc": date, "results": [result]}


def _train_record(runs: list[tuple[str, float]], date: str) -> dict:
    results = [
        {"shape": "qwen3-4b", "sample_len": 32768, "core_attention": attn, "mfu": mfu, "hardware": "NVIDIA H100"}
        for attn, mfu in runs
    ]
    return {"benchmark": "train", "date_utc": date, "results": results}


def _write(folder: Path, name: str, record: dict) -> None:
    (folder / name).write_text(json.dumps(record))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    folder = tmp_path / "benchmarks" / "results"
    folder.mkdir(parents=True)
    return folder


def test_exact_overhead_pairs_the_two_records_of_one_call(results):
    _write(results, "one_gpu_limits_step_step_resident_h100.json", _step_record("x", 3.3, "2026-12-07T04:00:00"))
    _write(results, "one_gpu_limits_step_step_fast_h100.json", _step_record("y", 3.0, "2026-12-07T04:01:00"))
    _write(results, "one_gpu_limits_step_step_fast_h200.json", _step_record("y", 2.0, "2026-12-08T04:01:00"))
    # the newer fast record has no resident record beside it: it is not a pair
    path, reading = one_gpu_limits.exact_overhead(results)
    assert path.name == "one_gpu_limits_step_step_resident_h100.json"
    assert reading.value == pytest.approx(0.1)
    row = one_gpu_limits.build(results, today="2026-12-07")["rows"]["exact_step_overhead"]
    assert row["value"] == pytest.approx(0.1) and row["meets_goal"] is True and row["measured_today"] is True


def test_exact_mfu_counts_only_kernels_exact_with_the_engine(results):
    runs = [
        ("FlashVarlenCoreAttention", 0.5),
        ("ChunkedVarlenCoreAttention", 0.31),
        ("EfficientVarlenCoreAttention", 0.2),
    ]
    _write(results, "one_gpu_limits_mfu_4b_h100.json", _train_record(runs, "2026-12-07T04:00:00"))
    _write(results, "bench_train_qwen3-4b_32k_full_h200.json", _train_record(runs[2:], "2026-12-01T00:00:00"))
    row = one_gpu_limits.build(results, today="2026-12-07")["rows"]["exact_mfu_4b_32k"]
    assert row["value"] == 0.31 and row["meets_goal"] is False
    assert row["source"].endswith("one_gpu_limits_mfu_4b_h100.json")
    assert "ChunkedVarlenCoreAttention" in row["note"]


def test_a_row_no_file_holds_is_reported_unmeasured(results):
    rows = one_gpu_limits.build(results)["rows"]
    assert rows["sync_s_8b"]["value"] is None and "not measured" in rows["sync_s_8b"]["note"]
    assert rows["exact_step_overhead"]["value"] is None
