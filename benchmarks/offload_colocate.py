"""Colocated GRPO with and without offload on one GPU: the memory each side keeps while the other works.

Runs ``rlrun train configs/quickstart.yaml`` under torchrun (1 rank, embedded engine, bf16) on a random-init
Qwen3-0.6B-shaped model with the tests' byte-level ChatML tokenizer (a random model's ids beyond its
vocabulary decode to nothing, so rewards are 0 and ``skip_tied_groups`` is off to keep every step training),
with ``offload.train/rollout`` on (NCCL communicators torn down around sleep), on with
``offload.teardown_nccl=false`` (communicators kept), and off, and summarises each run's metrics.jsonl.

    python benchmarks/offload_colocate.py --out benchmarks/results/offload_qwen3-0.6b_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlrun.tools.bench.logged import run_logged  # noqa: E402
from rlrun.tools.bench.shapes import get_shape, write_random_model  # noqa: E402
from rlrun.tools.bench.step import TORCHRUN_ENV  # noqa: E402
from tests.tiny_models import make_tokenizer  # noqa: E402

RUNS = {"offload_on": (True, True), "offload_on_keep_nccl": (True, False), "offload_off": (False, False)}
"""Run name -> (offload.train/rollout, offload.teardown_nccl)."""


def overrides(model_dir: Path, run_dir: Path, offload: bool, steps: int, teardown_nccl: bool) -> list[str]:
    sets = {
        "model.path": model_dir,
        "model.dtype": "bfloat16",
        "train.num_steps": steps,
        "rollout.prompts_per_step": 8,
        "rollout.samples_per_prompt": 8,
        "rollout.max_new_tokens": 64,
        "train.max_tokens_per_micro_batch": 8192,
        "algorithm.skip_tied_groups": "false",
        "offload.train": str(offload).lower(),
        "offload.rollout": str(offload).lower(),
        "offload.teardown_nccl": str(teardown_nccl).lower(),
        "logging.run_dir": run_dir,
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def run(model_dir: Path, run_dir: Path, offload: bool, steps: int, timeout_s: float, teardown_nccl: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "-m",
        "rlrun",
        "train",
        "configs/quickstart.yaml",
        *overrides(model_dir, run_dir, offload, steps, teardown_nccl),
    ]
    start = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "torchrun.log"
    returncode = run_logged(cmd, log, timeout_s, env={**os.environ, **TORCHRUN_ENV})
    wall = time.perf_counter() - start
    rows = (
        [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    out = {
        "offload": offload,
        "teardown_nccl": teardown_nccl,
        "command": " ".join(cmd[1:]),
        "returncode": returncode,
        "wall_s": round(wall, 1),
        "steps": rows,
        "summary": summarise(rows),
    }
    if returncode != 0:
        out["log_tail"] = log.read_text()[-4000:]
    return out


def _col(rows: list[dict], key: str) -> list[float]:
    return [r.get(key, math.nan) for r in rows]


def summarise(rows: list[dict]) -> dict:
    """The offload goals: trainer resident in rollout <= 5% of its peak, engine ~0 during training, peak at
    step 5 within 1% of step 2; sleep/wake seconds and GB/s."""
    if len(rows) < 5:
        return {"error": f"only {len(rows)} steps logged"}
    peak = [
        max(a, b)
        for a, b in zip(_col(rows, "memory/train/trainer_gb"), _col(rows, "memory/sync/trainer_gb"), strict=False)
    ]
    rollout_trainer = _col(rows, "memory/rollout/trainer_gb")
    steady = slice(1, None)
    out = {
        "trainer_peak_gb_per_step": peak,
        "trainer_during_rollout_gb_per_step": rollout_trainer,
        "engine_during_train_gb_per_step": _col(rows, "memory/train/engine_gb"),
        "engine_during_rollout_gb_per_step": _col(rows, "memory/rollout/engine_gb"),
        "device_during_rollout_gb_per_step": _col(rows, "memory/rollout/device_gb"),
        "device_during_train_gb_per_step": _col(rows, "memory/train/device_gb"),
        "trainer_max_allocated_gb_per_step": _col(rows, "memory/trainer_max_allocated_gb"),
        "trainer_rollout_over_peak": max(r / p for r, p in zip(rollout_trainer[steady], peak[steady], strict=False)),
        "peak_step5_over_step2": peak[4] / peak[1],
        "device_peak_step5_over_step2": rows[4]["memory/train/device_gb"] / rows[1]["memory/train/device_gb"],
        "step_s_mean": sum(_col(rows, "time/step_s")[steady]) / (len(rows) - 1),
        "nccl_groups_destroyed_per_step": _col(rows, "offload/nccl_groups_destroyed"),
    }
    for what in ("sleep", "wake"):
        for unit in ("s", "gb", "gb_per_s"):
            vals = [v for v in _col(rows, f"offload/trainer_{what}_{unit}")[steady] if not math.isnan(v)]
            if vals:
                out[f"trainer_{what}_{unit}_mean"] = round(sum(vals) / len(vals), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=150)
    parser.add_argument("--work", type=Path, default=Path("/tmp/offload_bench"))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    args = parser.parse_args()
    runs = {name: RUNS[name] for name in args.runs.split(",")}
    model_dir = write_random_model(get_shape("qwen3-0.6b"), args.work / "qwen3-0.6b", torch.bfloat16, "cuda")
    make_tokenizer().save_pretrained(model_dir)
    torch.cuda.empty_cache()
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    result = {
        "model": "random-init Qwen3-0.6B shape, bf16, tied embeddings",
        "gpu": smi,
        "config": "configs/quickstart.yaml + "
        + " ".join(overrides(Path("<model>"), Path("<run>"), True, args.steps, True)),
        "runs": {},
    }
    for name, (offload, teardown_nccl) in runs.items():
        result["runs"][name] = run(model_dir, args.work / name, offload, args.steps, args.timeout_s, teardown_nccl)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    summary = {name: result["runs"].get(name, {}).get("summary", {"error": "not run"}) for name in RUNS}
    on, keep, off = (summary[name] for name in RUNS)
    if "error" not in on and "error" not in off:
        result["saved_gb"] = {
            "device_during_rollout": off["device_during_rollout_gb_per_step"][-1]
            - on["device_during_rollout_gb_per_step"][-1],
            "device_during_train": off["device_during_train_gb_per_step"][-1]
            - on["device_during_train_gb_per_step"][-1],
        }
    if "error" not in on and "error" not in keep:
        result["nccl_teardown_saved_gb"] = {
            "trainer_during_rollout": keep["trainer_during_rollout_gb_per_step"][-1]
            - on["trainer_during_rollout_gb_per_step"][-1],
            "trainer_rollout_over_peak": {
                "teardown": on["trainer_rollout_over_peak"],
                "keep_nccl": keep["trainer_rollout_over_peak"],
            },
        }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v["summary"] for k, v in result["runs"].items()}, indent=1))


if __name__ == "__main__":
    main()
