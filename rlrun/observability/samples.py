"""``logging.log_samples``: what the model says. The first N samples of each step, one JSON line each in
``RUN_DIR/samples.jsonl`` (and a W&B table ``samples`` when W&B is on), so a run can be read, not only plotted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlrun.data.sample import Sample

SAMPLES_FILE = "samples.jsonl"
COLUMNS = ("step", "prompt", "response", "reward", "finish_reason", "label")


def sample_rows(step: int, samples: list[Sample]) -> list[dict[str, Any]]:
    """One row per sample: the step (0-based), the prompt as the model saw it, the response, its reward."""
    return [
        {
            "step": step,
            "prompt": s.prompt.prompt_text,
            "response": s.response_text,
            "reward": s.reward,
            "finish_reason": s.finish_reason,
            "label": s.prompt.label
            if isinstance(s.prompt.label, (str, int, float, type(None)))
            else str(s.prompt.label),
        }
        for s in samples
    ]


def write_samples(run_dir: Path, rows: list[dict[str, Any]], wandb_run: Any = None) -> None:
    """Append ``rows`` to ``run_dir/samples.jsonl``; with a W&B run, also log them as the table ``samples``."""
    with (run_dir / SAMPLES_FILE).open("a") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
    if wandb_run is not None and rows:
        import wandb

        table = wandb.Table(
            columns=list(COLUMNS), data=[[str(row[c]) if c == "label" else row[c] for c in COLUMNS] for row in rows]
        )
        wandb_run.log({"samples": table}, step=rows[0]["step"])
