"""Eight CPU ranks through `rlrun train`: composite layouts against a one-rank baseline on the same data.

    python scripts/cluster_layouts.py [--work DIR] [--layouts dense_tp2_pp2_dp2 moe_pp2_ep2_etp2] [--out DIR]

For each model (tiny random Qwen3 and Qwen3-MoE from tests/tiny_models.py, fp32, gloo) a one-rank run of 3
GRPO steps saves every step's samples (``debug.save_rollout_data``); each layout then trains on them under
``torchrun --nproc-per-node 8`` (``debug.load_rollout_data``: the same data, the same seed). With an entropy
bonus the step-0 loss depends on the model's numerics, so step 0's loss, entropy and gradient norm must equal
the baseline's to ``REL`` and the later steps' losses to ``10 * REL`` (the optimizer updates agree too).

Layouts (8 ranks each):

* ``dense_tp2_pp2_dp2``: trainer TP=2 x PP=2 x DP=2, ``engine.tp: 2`` (four engine groups of two ranks);
* ``moe_pp2_ep2_etp2``: Qwen3-MoE at PP=2 with EP=2 x expert-TP=2 in each stage (4 dense data-parallel
  ranks; MoE models run at ``parallel.tp: 1``), one engine per rank.

The other layouts take the MoE one apart. Megatron computes the load-balancing loss per micro-batch and rank
(``moe_router_load_balancing_type: aux_loss``): at four data-parallel ranks each packs a quarter of the step's
samples into its micro-batch where one rank packs them all into one, so the loss, and the router's gradient,
are another function of the same data (``moe_dp4``, no expert or pipeline parallelism, moves the norm as much
as ``moe_pp2_ep2_etp2``). The ``_per_sample`` rows and their baseline train every sample as a micro-batch of
its own (``PER_SAMPLE``), the same micro-batches at any layout, so there the load-balancing loss must match too.

Writes ``cluster_layouts_cpu.json`` and ``cluster_layouts_cpu.md`` (the table) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REL = 1e-5
KEYS = ("train/loss", "train/entropy", "train/grad_norm")
COMMON = (
    "model.dtype=float32",
    "train.num_steps=3",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "rollout.ignore_eos=true",
    "rollout.reward=rlrun.tools.bench.step:even_token_reward",
    "optimizer.lr=1e-3",
    "algorithm.skip_tied_groups=false",
    "algorithm.entropy_coef=0.01",
    "checkpoint.save_interval=0",
    "checkpoint.save_at_end=false",
    "checkpoint.export_at_end=false",
)
NO_AUX = "model.moe.aux_loss_coeff=0"
PER_SAMPLE = "train.max_tokens_per_micro_batch=16"
"""Below any sample's length: every sample is a micro-batch of its own (the packer never drops one)."""
SHARED = {NO_AUX: "noaux", PER_SAMPLE: "per_sample"}
"""Set in a layout's settings, the baseline runs with it too (a baseline per model and these settings; the
value names it)."""
LAYOUTS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    # name: (model kind, ranks, settings)
    "dense_tp2_pp2_dp2": ("qwen3", 8, ("parallel.tp=2", "parallel.pp=2", "engine.tp=2")),
    # The gate is off for MoE: from step 1 on, an fp32 round-off in the weights can flip a near-tied top-2
    # expert choice for a few tokens, so the baseline engine's log-probs are not this trainer's to 1e-4.
    "moe_pp2_ep2_etp2": (
        "qwen3_moe",
        8,
        ("parallel.pp=2", "parallel.ep=2", "parallel.etp=2", "algorithm.max_logprob_gap=null"),
    ),
    # its parts, on fewer ranks: which one moves the gradient norm
    "moe_ep2": ("qwen3_moe", 2, ("parallel.ep=2", "algorithm.max_logprob_gap=null")),
    "moe_etp2": ("qwen3_moe", 2, ("parallel.etp=2", "algorithm.max_logprob_gap=null")),
    "moe_pp2": ("qwen3_moe", 2, ("parallel.pp=2", "algorithm.max_logprob_gap=null")),
    "moe_dp2": ("qwen3_moe", 2, ("algorithm.max_logprob_gap=null",)),
    "moe_ep2_etp2": ("qwen3_moe", 4, ("parallel.ep=2", "parallel.etp=2", "algorithm.max_logprob_gap=null")),
    # four data-parallel ranks alone: other micro-batches than one rank's, so another load-balancing loss
    "moe_dp4": ("qwen3_moe", 4, ("algorithm.max_logprob_gap=null",)),
    # without the load-balancing loss: expert-TP's gradient without the aux term
    "moe_pp2_ep2_etp2_noaux": ("qwen3_moe", 8, ("parallel.pp=2", "parallel.ep=2", "parallel.etp=2", NO_AUX)),
    "moe_etp2_noaux": ("qwen3_moe", 2, ("parallel.etp=2", "algorithm.max_logprob_gap=null", NO_AUX)),
    "moe_ep2_etp2_noaux": ("qwen3_moe", 4, ("parallel.ep=2", "parallel.etp=2", NO_AUX)),
    # with the load-balancing loss, every sample its own micro-batch here and in the baseline
    "moe_dp4_per_sample": ("qwen3_moe", 4, ("algorithm.max_logprob_gap=null", PER_SAMPLE)),
    "moe_pp2_ep2_etp2_per_sample": (
        "qwen3_moe",
        8,
        ("parallel.pp=2", "parallel.ep=2", "parallel.etp=2", "algorithm.max_logprob_gap=null", PER_SAMPLE),
    ),
}


def train(run_dir: Path, model_dir: Path, ranks: int, *settings: str, timeout_s: float = 1500) -> dict:
    """One ``rlrun train`` under torchrun; its exit code, seconds and the end of its output."""
    sets = [
        a for s in (f"model.path={model_dir}", f"logging.run_dir={run_dir}", *COMMON, *settings) for a in ("--set", s)
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += ["-m", "rlrun", "train", str(REPO / "configs/quickstart.yaml"), *sets]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    start = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    output = proc.stdout + proc.stderr
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text(output)
    # the first error lines, not torchrun's summary of the ranks it then stopped
    errors = [line for line in output.splitlines() if "Error" in line and "UserWarning" not in line]
    return {
        "rc": proc.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "tail": "\n".join(errors[:10]) if proc.returncode else "",
    }


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def rel_diff(got: float, want: float) -> float:
    return abs(got - want) / abs(want)


def compare(layout: list[dict], baseline: list[dict]) -> dict:
    """Step 0's KEYS and every step's loss against the baseline's, with the verdict."""
    if [r["step"] for r in layout] != [r["step"] for r in baseline] or not baseline:
        return {"ok": False, "reason": f"steps {[r['step'] for r in layout]} vs {[r['step'] for r in baseline]}"}
    step0 = {
        k: {"layout": layout[0][k], "baseline": baseline[0][k], "rel": rel_diff(layout[0][k], baseline[0][k])}
        for k in KEYS
    }
    losses = [rel_diff(g["train/loss"], w["train/loss"]) for g, w in zip(layout, baseline, strict=True)]
    ok = all(v["rel"] < REL for v in step0.values()) and all(d < 10 * REL for d in losses)
    gaps = [r.get("train/logprob_gap") for r in layout]
    return {"ok": ok, "step0": step0, "loss_rel_per_step": losses, "logprob_gap_per_step": gaps}


def done(run_dir: Path) -> bool:
    """A finished run of all COMMON's steps is there already (``--reuse``)."""
    return len(rows(run_dir)) == 3


def run_layouts(work: Path, names: list[str], reuse: bool = False) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_model

    result: dict = {"dtype": "float32", "rel_tolerance_step0": REL, "layouts": {}, "baselines": {}}
    for name in names:
        kind, ranks, settings = LAYOUTS[name]
        model_dir = work / "models" / kind
        if not (model_dir / "config.json").is_file():
            make_tiny_model(kind, model_dir)
        shared = tuple(s for s in SHARED if s in settings)
        base_dir = work / "runs" / "_".join(("baseline", kind, *(SHARED[s] for s in shared)))
        if not done(base_dir):
            result["baselines"][base_dir.name] = train(base_dir, model_dir, 1, "debug.save_rollout_data=true", *shared)
        run_dir = work / "runs" / name
        if reuse and done(run_dir):
            run = {"rc": 0, "seconds": None, "tail": "", "reused": True}
        else:
            run = train(run_dir, model_dir, ranks, *settings, f"debug.load_rollout_data={base_dir / 'debug'}")
        engines = sorted(p.name for p in run_dir.glob("engine-*.log"))
        result["layouts"][name] = {
            "model": kind,
            "ranks": ranks,
            "settings": list(settings),
            "engine_logs": engines,
            **run,
            **compare(rows(run_dir), rows(base_dir)),
        }
    return result


def markdown(result: dict) -> str:
    lines = [
        "| layout | ranks | model | step-0 loss (layout / 1 rank) | rel | entropy rel | grad norm (layout / 1 rank) | "
        "rel | later losses max rel | ok |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["layouts"].items():
        if "step0" not in r:
            lines.append(f"| {name} | {r['ranks']} | {r['model']} | - | - | - | - | - | - | no (rc {r['rc']}) |")
            continue
        loss, entropy, grad = (r["step0"][k] for k in KEYS)
        lines.append(
            f"| {name} | {r['ranks']} | {r['model']} | {loss['layout']:.8f} / {loss['baseline']:.8f} | "
            f"{loss['rel']:.1e} | {entropy['rel']:.1e} | {grad['layout']:.6f} / {grad['baseline']:.6f} | "
            f"{grad['rel']:.1e} | {max(r['loss_rel_per_step'][1:], default=0):.1e} | {'yes' if r['ok'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="models and runs (default: a new temp dir)")
    parser.add_argument(
        "--layouts", nargs="+", default=["dense_tp2_pp2_dp2", "moe_pp2_ep2_etp2"], choices=list(LAYOUTS)
    )
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --work")
    parser.add_argument("--out", type=Path, default=None, help="where the JSON and the table go (default: --work)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="cluster-layouts-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    result = run_layouts(work, args.layouts, args.reuse)
    result["command"] = "python scripts/cluster_layouts.py " + " ".join(sys.argv[1:])
    (out / "cluster_layouts_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (out / "cluster_layouts_cpu.md").write_text(f"`{result['command']}`\n\n{table}\n")
    print(table)
    sys.exit(0 if all(r["ok"] for r in result["layouts"].values()) else 1)


if __name__ == "__main__":
    main()
