"""Run rlrun train variants on one GPU and summarise their metrics.jsonl into one JSON (written after every
run, so a timed-out call keeps the finished ones).

  python3 scripts/gpu/onpolicy_bench.py OUT.json NAME CONFIG [KEY=VALUE ...] -- NAME CONFIG [KEY=VALUE ...] ...

Per run: the trainer-vs-engine gap (train/logprob_gap) at step 0, its max and mean over the run,
train/abs_log_ratio at step 0 (0: ratio exactly 1), the train phase's seconds (time/train_s; median over
steps 1.. as step 0 includes warm-up), the mean reward of the first and last 10 steps, and the wall time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def summarise(records: list[dict]) -> dict:
    trained = [r for r in records if "train/logprob_gap" in r]
    gaps = [r["train/logprob_gap"] for r in trained]
    train_s = [r["time/train_s"] for r in trained if r["step"] > 0 and "time/train_s" in r]
    rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    first = trained[0] if trained else {}
    return {
        "steps": len(records),
        "trained_steps": len(trained),
        "gap_step0": first.get("train/logprob_gap") if first.get("step") == 0 else None,
        "gap_first_trained": first.get("train/logprob_gap"),
        "gap_max": max(gaps) if gaps else None,
        "gap_mean": statistics.fmean(gaps) if gaps else None,
        "abs_log_ratio_step0": first.get("train/abs_log_ratio") if first.get("step") == 0 else None,
        "approx_kl_step0": first.get("train/approx_kl") if first.get("step") == 0 else None,
        "train_phase_s_median": statistics.median(train_s) if train_s else None,
        "train_phase_s_mean": statistics.fmean(train_s) if train_s else None,
        "logprobs_phase_s_median": statistics.median(
            [r["time/logprobs_s"] for r in trained if r["step"] > 0 and "time/logprobs_s" in r] or [0.0]
        ),
        "reward_first10": statistics.fmean(rewards[:10]) if rewards else None,
        "reward_last10": statistics.fmean(rewards[-10:]) if rewards else None,
    }


def main(argv: list[str]) -> None:
    out_path, runs, current = Path(argv[0]), [], []
    for arg in argv[1:] + ["--"]:
        if arg == "--":
            if current:
                runs.append(current)
            current = []
        else:
            current.append(arg)
    results = {"runs": {}}
    for name, config, *overrides in runs:
        run_dir = Path("runs") / name
        sets = [a for o in [f"logging.run_dir={run_dir}", *overrides] for a in ("--set", o)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        cmd += ["-m", "rlrun", "train", config, *sets]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        row = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "wall_s": time.perf_counter() - start}
        row.update(summarise(records))
        if proc.returncode != 0:  # the worker's own error lines: torchrun's traceback follows them and says nothing
            row["error_lines"] = [line for line in proc.stderr.splitlines() if "Error" in line][:20]
            row["stderr_tail"] = proc.stderr.splitlines()[-30:]
            engine_log = run_dir / "engine-0.log"
            if engine_log.exists():
                row["engine_log_tail"] = engine_log.read_text().splitlines()[-20:]
        results["runs"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
        out_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
