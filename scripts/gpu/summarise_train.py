"""A GPU training run's figures from its metrics.jsonl: the trainer-vs-engine log-prob gap at step 0, memory
at each phase boundary and seconds per phase, every step; written as JSON beside the full rows.

    python scripts/gpu/summarise_train.py RUN_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GAP_GOAL = 0.01
"""bf16 goal for the mean absolute trainer-vs-engine log-prob gap (train/logprob_gap)."""


def summarise(rows: list[dict]) -> dict:
    steps = [
        {
            key: value
            for key, value in row.items()
            if key == "step" or key == "train/logprob_gap" or key.startswith(("memory/", "time/", "offload/"))
        }
        for row in rows
    ]
    gap = rows[0].get("train/logprob_gap") if rows else None
    return {
        "steps_logged": len(rows),
        "logprob_gap_step0": gap,
        "logprob_gap_goal_met": gap is not None and gap <= GAP_GOAL,
        "per_step": steps,
    }


def main() -> None:
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = summarise(rows)
    out.write_text(json.dumps({"run_dir": str(run_dir), **summary, "rows": rows}, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}))


if __name__ == "__main__":
    main()
