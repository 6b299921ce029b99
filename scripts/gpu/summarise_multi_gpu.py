"""The multi-GPU figures from the runs of scripts/gpu/multi_gpu.sh, as JSON beside the rows they come from.

``layouts RUNS OUT_JSON``: each layout's (TP=2, DP=2, PP=2, ...) first-step loss, entropy and gradient norm
against the TP=1 DP=1 baseline trained on the same saved samples, within the tolerance of the runs'
dtype; the engine.tp=2 run's engine-vs-trainer log-prob gap after each weight sync.
``scaling OUT_JSON BENCH_JSON...``: weak-scaling efficiency t(1)/t(N) from ``rlrun bench step`` results
(rlrun/tools/bench/step.py StepResult as JSON) with the same samples per rank.

    python scripts/gpu/summarise_multi_gpu.py layouts /tmp/runs/multi_gpu $OUT/multi_gpu_layouts.json
    python scripts/gpu/summarise_multi_gpu.py scaling $OUT/weak_scaling.json \
        bench_step_ranks1.json bench_step_ranks2.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import yaml

LAYOUTS = ("tp2", "dp2", "pp2", "tp2dp2", "tp2pp2", "tp2pp2dp2")
ENGINE_RUNS = ("engine_tp2", "engine_tp2_sglang")  # trainer TP=2 feeding one engine of engine.tp=2
"""Runs compared with ``baseline`` (the step names of multi_gpu.sh)."""
COMPARED = ("train/loss", "train/entropy", "train/grad_norm")
"""Step-0 metrics each layout must reproduce. The policy term of the loss has ratio 1 at step 0 in any
layout, so the entropy bonus (algorithm.entropy_coef) is what makes the loss depend on the numerics."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a layout's step-0 figures may sit from the baseline's: ``|got - want| <= rel * |want|``."""

    loss_rel: float
    grad_norm_rel: float
    logprob_gap: float
    """Bound on the mean engine-vs-trainer log-prob gap (train/logprob_gap) after a weight sync."""


TOLERANCES = {
    # fp32 (CPU/gloo): TP/PP/DP only reorder sums; measured on the tiny shape: <= 1.4e-6 relative.
    "float32": Tolerance(loss_rel=1e-5, grad_norm_rel=1e-4, logprob_gap=1e-4),
    # bf16 keeps 8 mantissa bits (rounding 2^-9 = 0.2% per element). TP=2 all-reduces the row-parallel
    # outputs in bf16 and splits each matmul's sum, so per-token log-probs move by ~1e-2 (the H200's
    # trainer-vs-engine gap was 0.008 mean); the loss and entropy are means over ~4k tokens whose
    # rounding errors mostly cancel: 1%. The gradient norm sums squares of bf16 gradients whose
    # reduction order differs by layout: 5%. The log-prob gap goal is the one-GPU goal (0.01).
    "bfloat16": Tolerance(loss_rel=1e-2, grad_norm_rel=5e-2, logprob_gap=1e-2),
}


def read_run(run_dir: Path) -> dict | None:
    """The run's config and metrics rows, or None when it has not run."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return {"config": config, "rows": rows, "engines": len(list(run_dir.glob("engine-*.log")))}


def compare(layout: dict, baseline: dict, tol: Tolerance) -> dict:
    """Step-0 differences of one layout from the baseline, relative to the baseline's value."""
    got, want = layout["rows"][0], baseline["rows"][0]
    bounds = {"train/loss": tol.loss_rel, "train/entropy": tol.loss_rel, "train/grad_norm": tol.grad_norm_rel}
    out = {
        "steps_logged": len(layout["rows"]),
        "parallel": layout["config"]["parallel"],
        "ranks": layout["engines"],
    }  # one engine per rank at engine.tp=1
    for key in COMPARED:
        rel = abs(got[key] - want[key]) / abs(want[key])
        out[key] = {
            "layout": got[key],
            "baseline": want[key],
            "rel_diff": rel,
            "bound": bounds[key],
            "ok": rel <= bounds[key],
        }
    out["loss_per_step"] = [row["train/loss"] for row in layout["rows"]]
    out["logprob_gap_per_step"] = [row["train/logprob_gap"] for row in layout["rows"]]
    out["ok"] = out["steps_logged"] == len(baseline["rows"]) and all(out[key]["ok"] for key in COMPARED)
    return out


def engine_tp2(run: dict, tol: Tolerance) -> dict:
    """The engine.tp=2 run: log-prob gaps after the syncs of steps 0 and 1 (logged at steps 1 and 2)."""
    gaps = [row["train/logprob_gap"] for row in run["rows"]]
    synced = gaps[1:]
    return {
        "steps_logged": len(gaps),
        "parallel": run["config"]["parallel"],
        "engine_tp": run["config"]["engine"]["tp"],
        "backend": run["config"]["engine"]["backend"],
        "logprob_gap_per_step": gaps,
        "bound": tol.logprob_gap,
        "ok": len(synced) >= 1 and max(synced) <= tol.logprob_gap,
    }


def layouts(runs: Path) -> dict:
    """Every layout against the baseline, and the engine runs (which need no baseline: a call that
    starts on a cold machine may hold only an engine run)."""
    baseline = read_run(runs / "baseline")
    found = {name: read_run(runs / name) for name in (*LAYOUTS, *ENGINE_RUNS)}
    if baseline is None and any(found[name] is not None for name in LAYOUTS):
        raise SystemExit(
            f"baseline run ({runs / 'baseline'}) must exist because every layout is compared "
            "with it; run the baseline step of scripts/gpu/multi_gpu.sh"
        )
    first = baseline or next((run for run in found.values() if run is not None), None)
    if first is None:
        raise SystemExit(f"no run under {runs}: run the steps of scripts/gpu/multi_gpu.sh first")
    dtype = first["config"]["model"]["dtype"]
    tol = TOLERANCES[dtype]
    out = {
        "dtype": dtype,
        "tolerance": dataclasses.asdict(tol),
        "baseline_rows": baseline["rows"] if baseline else [],
        "layouts": {
            name: compare(run, baseline, tol)
            for name, run in found.items()
            if run is not None and name not in ENGINE_RUNS
        },
        "not_run": [name for name, run in found.items() if run is None],
    }
    for name in ENGINE_RUNS:
        if found[name] is not None:
            out[name] = engine_tp2(found[name], tol)
    out["rows"] = {name: run["rows"] for name, run in found.items() if run is not None}
    return out


def scaling(results: list[dict]) -> dict:
    """Efficiency t(1)/t(N) of the median step seconds at the same samples per rank."""
    per_rank = {r["samples_per_rank"] for r in results}
    if len(per_rank) != 1 or 1 not in {r["ranks"] for r in results}:
        raise SystemExit(
            f"bench step results (samples per rank {sorted(per_rank)}, ranks "
            f"{sorted(r['ranks'] for r in results)}) must share one samples-per-rank figure and "
            "include a 1-rank run because weak scaling fixes the per-GPU work; rerun them"
        )
    one = next(r for r in results if r["ranks"] == 1)["median_step_s"]
    rows = [
        {
            "ranks": r["ranks"],
            "samples_per_rank": r["samples_per_rank"],
            "median_step_s": r["median_step_s"],
            "median_phases_s": r["median_phases_s"],
            "median_tokens_per_s": r["median_tokens_per_s"],
            "efficiency": one / r["median_step_s"],
            "hardware": r["hardware"],
            "dtype": r["dtype"],
        }
        for r in sorted(results, key=lambda r: r["ranks"])
    ]
    return {
        "definition": "efficiency = median s/step at 1 rank / median s/step at N ranks, same samples per rank",
        "settings": results[0]["settings"],
        "runs": rows,
    }


def main() -> None:
    kind = sys.argv[1]
    if kind == "layouts":
        out, summary = Path(sys.argv[3]), layouts(Path(sys.argv[2]))
        brief = {k: v for k, v in summary.items() if k not in ("rows", "baseline_rows")}
    elif kind == "scaling":
        out = Path(sys.argv[2])
        summary = brief = scaling([json.loads(Path(p).read_text()) for p in sys.argv[3:]])
    else:
        raise SystemExit(f"kind ({kind!r}) must be layouts or scaling; see this script's docstring")
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(brief, indent=1))


if __name__ == "__main__":
    main()
