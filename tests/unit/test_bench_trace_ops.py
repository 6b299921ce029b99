"""rlrun/tools/bench/trace_ops.py against torch's own key_averages (CPU ops) and a hand-built trace (device time).

References: ``prof.key_averages()`` of the same profile for calls and self CPU time of the ops inside the
phase; for kernels, the sums written into the hand-built trace.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from rlrun.tools.bench.trace_ops import phase_profile


def test_cpu_table_matches_key_averages(tmp_path):
    torch.set_num_threads(1)
    x = torch.randn(48, 48)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("train"):
            for _ in range(3):
                torch.relu(x @ x).sum()
        with record_function("sync"):
            torch.cos(x)  # outside the phase: must not appear
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))

    table = phase_profile(trace, "train", step=4, top=50)
    rows = {r.name: r for r in table.ops}
    assert "aten::cos" not in rows and table.step == 4 and table.device_us == 0
    reference = {e.key: e for e in prof.key_averages() if e.key not in ("train", "sync", "aten::cos")}
    assert {"aten::mm", "aten::relu", "aten::sum"} <= set(rows)
    for name, row in rows.items():
        assert row.calls == reference[name].count, name
        assert row.cpu_self_us == pytest.approx(reference[name].self_cpu_time_total, abs=2.0), name
        assert row.cpu_total_us == pytest.approx(reference[name].cpu_time_total, abs=2.0), name
    assert [r.cpu_self_us for r in table.ops] == sorted((r.cpu_self_us for r in table.ops), reverse=True)
    assert max(r.cpu_total_us for r in table.ops) <= table.phase_us


def _event(cat, name, ts, dur, ext=None, tid=1):
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": {} if ext is None else {"External id": ext},
    }


def test_device_time_is_charged_to_the_launching_op(tmp_path):
    events = [
        _event("user_annotation", "train", 0, 100),
        _event("cpu_op", "aten::linear", 10, 40, ext=1),
        _event("cpu_op", "aten::mm", 15, 20, ext=2),  # nested in linear: linear's self = 40 - 20
        _event("cpu_op", "aten::mm", 60, 10, ext=3),
        _event("cpu_op", "aten::mm", 62, 6, ext=5),  # mm inside mm: part of its parent (torch's events drop it)
        _event("cpu_op", "aten::fill_", 63, 2, ext=6),  # ... so this one is the outer mm's child
        _event("cpu_op", "aten::add", 200, 5, ext=4),  # after the phase
        _event("kernel", "gemm_a", 300, 7, ext=2, tid=7),  # runs after the range ends: still the phase's
        _event("kernel", "gemm_a", 310, 9, ext=5, tid=7),  # launched by the nested mm: charged to mm
        _event("gpu_memcpy", "Memcpy DtoD", 320, 4, ext=1, tid=7),
        _event("kernel", "add_kernel", 330, 50, ext=4, tid=7),  # launched outside the phase
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    table = phase_profile(trace, "train", step=0)
    rows = {r.name: r for r in table.ops}
    assert set(rows) == {"aten::linear", "aten::mm", "aten::fill_"}
    assert (rows["aten::mm"].calls, rows["aten::mm"].device_us, rows["aten::mm"].cpu_self_us) == (2, 16, 28)
    assert (rows["aten::mm"].cpu_total_us, rows["aten::fill_"].cpu_self_us) == (30, 2)
    assert (rows["aten::linear"].device_us, rows["aten::linear"].cpu_self_us, rows["aten::linear"].cpu_total_us) == (
        4,
        20,
        40,
    )
    assert table.device_us == 20 and table.phase_us == 100
    assert [(k.name, k.calls, k.device_us) for k in table.kernels] == [("gemm_a", 2, 16), ("Memcpy DtoD", 1, 4)]
    with pytest.raises(ValueError, match="rollout"):
        phase_profile(trace, "rollout", step=0)
