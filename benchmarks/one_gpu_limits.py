"""One GPU against the hardware's limits: the newest measured value of each row, read from the result JSON files
under benchmarks/results/, written as one object (``benchmarks/results/one_gpu_limits.json``).

Each row names the files that measure it and how to read the value; of those that hold a value, the newest by the
record's own ``date_utc`` wins, and the object keeps its file, date and card. ``rollout_fraction_of_bound`` is the
embedded engine's greedy tokens/s over the HBM bound of rlrun/tools/bench/rollout.py (weights plus every row's K/V at
the call's mean context, at the card's bandwidth); a file written before that bound counted the K/V is recomputed
from its own tokens/s, weight bytes, batch and lengths (``"recomputed": true``).

    python benchmarks/one_gpu_limits.py                      # writes benchmarks/results/one_gpu_limits.json
    python benchmarks/one_gpu_limits.py --out /tmp/limits.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlrun.tools.bench.rollout import BandwidthBound, kv_bytes_per_token  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
GOALS = {
    "onpolicy_gap_max": ("<=", 1e-6),
    "exact_mfu_4b_32k": (">=", 0.40),
    "step_s_1p7b_resident": ("<=", 3.0),
    "step_s_1p7b_offload": ("<=", 3.5),
    "rollout_fraction_of_bound": (">=", 0.60),
    "sync_s_8b": ("<=", 0.03),
    "sleep_s_0p6b": ("<=", 0.3),
    "wake_s_0p6b": ("<=", 0.25),
    "exact_step_overhead": ("<=", 0.10),
}
"""The bound each row is held to (on one H200)."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """One value read from one file: what it is, when and where it was measured."""

    value: float
    date_utc: str
    hardware: str
    note: str = ""
    recomputed: bool = False


Reader = Callable[[dict], Reading | None]


def _step_row(label: str, key: str, shape: str) -> Reader:
    """``median_step_s`` (key ``step``), ``max_logprob_gap`` (``gap``) or a ``median_offload`` entry of the
    ``bench step`` run ``label`` in a peer_step record (``results.<label>``) or a bench step record."""

    def read(record: dict) -> Reading | None:
        if record.get("benchmark") == "peer_step":
            run = record["results"].get(label)
            if run is None:
                return None
            date, result = run["date_utc"], run["results"][0]
        elif record.get("benchmark") == "step":
            date, result = record["date_utc"], record["results"][0]
            if result["label"] != label:
                return None
        else:
            return None
        if result["settings"]["shape"] != shape:
            return None
        if key == "step":
            value = result["median_step_s"]
        elif key == "gap":
            value = result.get("max_logprob_gap")
        else:
            value = result["median_offload"].get(key)
        if value is None:
            return None
        note = f"bench step {label}, median of the steps after warm-up"
        if result.get("trainer_rollout_gb"):
            note += f"; trainer resident during rollout {result['trainer_rollout_gb']} GB"
        return Reading(value, date, result["hardware"], note)

    return read


def _gap_file(shape: str) -> Reader:
    """``shapes.<shape>.max`` of a scripts/gpu/onpolicy_gaps.py record."""

    def read(record: dict) -> Reading | None:
        run = record.get("shapes", {}).get(shape)
        if record.get("benchmark") != "onpolicy_gap" or run is None or run["max"] is None:
            return None
        placement = "offload" if run["offload"] else "resident"
        note = f"tests/gpu/test_onpolicy_qwen3_gpu.py, {placement}, every step's gap {run['gaps']}"
        return Reading(run["max"], record["date_utc"], record["hardware"], note)

    return read


EXACT_CORE_ATTENTION = ("EfficientVarlenCoreAttention", "ChunkedVarlenCoreAttention")
"""The trainer kernels whose forward is bitwise the embedded engine's (docs/on_policy.md)."""


def _train_mfu(shape: str, sample_len: int) -> Reader:
    """The best MFU of a ``bench train`` record at this shape and length on a kernel that is exact with the engine."""

    def read(record: dict) -> Reading | None:
        if record.get("benchmark") != "train":
            return None
        runs = [
            r
            for r in record["results"]
            if (r["shape"], r["sample_len"]) == (shape, sample_len) and r["core_attention"] in EXACT_CORE_ATTENTION
        ]
        if not runs:
            return None
        best = max(runs, key=lambda r: r["mfu"])
        return Reading(best["mfu"], record["date_utc"], best["hardware"], f"bench train, {best['core_attention']}")

    return read


def exact_overhead(results: Path) -> tuple[Path, Reading] | None:
    """The exact path's extra step time over the fastest attention that is not exact, on the same work: the newest
    ``step_fast`` record of scripts/gpu/one_gpu_limits.sh (flash_varlen) against the ``step_resident`` record the
    same call wrote beside it (the same name with ``step_resident``)."""
    found = []
    for fast_path in sorted(results.glob("one_gpu_limits_step_step_fast*.json")):
        exact_path = fast_path.with_name(fast_path.name.replace("step_fast", "step_resident"))
        if not exact_path.exists():
            continue
        fast, exact = (json.loads(p.read_text())["results"][0] for p in (fast_path, exact_path))
        fast_s, exact_s = fast["median_step_s"], exact["median_step_s"]
        shape = exact["settings"]["shape"]
        note = f"bench step {shape} resident, median step: exact (auto) {exact_s:.3f} s, flash_varlen {fast_s:.3f} s"
        date = json.loads(exact_path.read_text())["date_utc"]
        found.append((exact_path, Reading(exact_s / fast_s - 1.0, date, exact["hardware"], note)))
    return max(found, key=lambda item: item[1].date_utc, default=None)


def _rollout_fraction(shape: str, batch: int) -> Reader:
    """The embedded engine's greedy tokens/s over the K/V-counting bound, recomputed where the file predates it."""

    def read(record: dict) -> Reading | None:
        if record.get("benchmark") != "rollout":
            return None
        for r in record["results"]:
            if r["shape"] != shape or r["batch"] != batch or r.get("backend", "embedded") != "embedded":
                continue
            bound = r["bound"]
            if bound.get("kv_bytes_per_token"):
                return Reading(r["fraction_of_bound"], record["date_utc"], r["hardware"], "bench rollout, greedy")
            weight_bytes = round(bound["step_s"] * bound["hbm_bytes_per_s"])  # the weights-only bound's bytes
            element_size = {"bfloat16": 2, "float16": 2, "float32": 4}[r["dtype"]]
            kv = kv_bytes_per_token(shape, element_size)
            new = BandwidthBound.of(weight_bytes, bound["hbm_bytes_per_s"], batch, kv, r["prompt_len"], r["new_tokens"])
            fraction = r["engine"]["tokens_per_s"] / new.tokens_per_s
            note = f"bench rollout, greedy {r['engine']['tokens_per_s']:.0f} tok/s; bound recomputed with the K/V"
            return Reading(fraction, record["date_utc"], r["hardware"], note, recomputed=True)
        return None

    return read


def _sync(shape: str) -> Reader:
    def read(record: dict) -> Reading | None:
        if record.get("benchmark") != "sync":
            return None
        for r in record["results"]:
            if r["shape"] == shape and r.get("backend", "embedded") == "embedded":
                note = f"bench sync, embedded, buckets of {r['bucket_bytes'] // 2**20} MiB, median"
                return Reading(r["median_s"], record["date_utc"], r["hardware"], note)
        return None

    return read


STEP_17 = ["peer_step_qwen3-1.7b_all_peers_8105633_h200.json", "one_gpu_limits_step_*.json"]
STEP_06 = ["peer_step_qwen3-0.6b_all_peers_724b6d5_h200.json", "one_gpu_limits_step_*.json"]
ROLLOUT_17 = [
    "bench_rollout_qwen3-1.7b_embedded_sglang_b64_b128_e0130d2_repeat_h200.json",
    "one_gpu_limits_rollout*.json",
]
GAPS = ["onpolicy_gaps_*.json"]
ROWS: dict[str, tuple[list[str], Reader]] = {
    "onpolicy_gap_max/qwen3-0.6b": (
        [*STEP_06[:1], *GAPS],
        lambda r: _gap_file("qwen3-0.6b")(r) or _step_row("embedded_resident_headkept", "gap", "qwen3-0.6b")(r),
    ),
    "onpolicy_gap_max/qwen3-1.7b": (
        [*STEP_17[:1], *GAPS],
        lambda r: _gap_file("qwen3-1.7b")(r) or _step_row("embedded_resident_headkept", "gap", "qwen3-1.7b")(r),
    ),
    "onpolicy_gap_max/qwen3-4b": (GAPS, _gap_file("qwen3-4b")),
    "exact_mfu_4b_32k": (
        ["bench_train_qwen3-4b_32k_full_h200.json", "one_gpu_limits_mfu_4b*.json"],
        _train_mfu("qwen3-4b", 32768),
    ),
    "step_s_1p7b_resident": (STEP_17, _step_row("embedded_resident_headkept", "step", "qwen3-1.7b")),
    "step_s_1p7b_offload": (STEP_17, _step_row("embedded_headkept", "step", "qwen3-1.7b")),
    "rollout_fraction_of_bound/64": (ROLLOUT_17, _rollout_fraction("qwen3-1.7b", 64)),
    "rollout_fraction_of_bound/128": (ROLLOUT_17, _rollout_fraction("qwen3-1.7b", 128)),
    "sync_s_8b": (
        ["sync-qwen3-h200.json", "sync-qwen3-8b-2gib-h200.json", "one_gpu_limits_sync*.json"],
        _sync("qwen3-8b"),
    ),
    "sleep_s_0p6b": (STEP_06, _step_row("embedded_headkept", "trainer_sleep_s", "qwen3-0.6b")),
    "wake_s_0p6b": (STEP_06, _step_row("embedded_headkept", "trainer_wake_s", "qwen3-0.6b")),
}
"""Row -> (file names or globs under benchmarks/results, reader). ``a/b`` rows become ``{"a": {"b": ...}}``."""


def newest(patterns: list[str], read: Reader, results: Path) -> tuple[Path, Reading] | None:
    """The newest reading of a row among the files matching ``patterns``."""
    found = []
    for pattern in patterns:
        for path in sorted(results.glob(pattern)):
            reading = read(json.loads(path.read_text()))
            if reading is not None:
                found.append((path, reading))
    return max(found, key=lambda item: item[1].date_utc, default=None)


def build(results: Path = RESULTS, today: str | None = None) -> dict:
    """The one object: per row its value, goal, file, date, card and whether it was measured ``today`` (UTC)."""
    today = today or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    rows: dict = {}
    found = {name: newest(patterns, read, results) for name, (patterns, read) in ROWS.items()}
    found["exact_step_overhead"] = exact_overhead(results)
    for name, hit in found.items():
        row, _, key = name.partition("/")
        op, goal = GOALS[row]
        cell: dict = {"goal": f"{op} {goal}"}
        if hit is None:
            cell.update(value=None, source=None, note="not measured: no result file holds this row")
        else:
            path, reading = hit
            meets = reading.value <= goal if op == "<=" else reading.value >= goal
            cell.update(
                value=reading.value,
                meets_goal=meets,
                source=str(path.relative_to(results.parents[1])),
                date_utc=reading.date_utc,
                card=reading.hardware,
                measured_today=reading.date_utc.startswith(today),
                note=reading.note,
            )
            if reading.recomputed:
                cell["recomputed"] = True
        if key:
            rows.setdefault(row, {})[key] = cell
        else:
            rows[row] = cell
    return {
        "benchmark": "one_gpu_limits",
        "command": "python benchmarks/one_gpu_limits.py",
        "built_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "one_gpu_limits.json")
    args = parser.parse_args()
    text = json.dumps(build(), indent=2)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
