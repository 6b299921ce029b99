"""Each step's ``train/logprob_gap`` of the ``bench step`` runs under a folder (pytest's ``--basetemp`` of
tests/gpu/test_onpolicy_qwen3_gpu.py), by shape, as one JSON: the shape is read from the run's model
(``bench_step.yaml`` names it; its config.json's widths are matched to rlrun/tools/bench/shapes.py).

    python scripts/gpu/onpolicy_gaps.py /tmp/pt --commit abc1234 --out $OUT/onpolicy_gaps.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlrun.tools.bench.shapes import SHAPES  # noqa: E402

GATE = 1e-6


def shape_of(model_dir: Path) -> str:
    """The name in SHAPES whose widths are those of ``model_dir``'s config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    widths = (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"])
    names = [name for name, s in SHAPES.items() if (s.hidden, s.layers, s.intermediate) == widths]
    if len(names) != 1:
        raise ValueError(f"{model_dir}/config.json ({widths}) must match exactly one known shape; it matches {names}")
    return names[0]


def gaps_by_shape(root: Path) -> dict[str, dict]:
    """``{shape: {"run_dir", "label", "gaps", "max", "passes"}}`` for every run directory under ``root``."""
    out = {}
    for metrics in sorted(root.rglob("metrics.jsonl")):
        run_dir = metrics.parent
        config = yaml.safe_load((run_dir / "bench_step.yaml").read_text())
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        gaps = [row.get("train/logprob_gap") for row in rows]
        known = [g for g in gaps if g is not None]
        out[shape_of(Path(config["model"]["path"]))] = {
            "run_dir": str(run_dir),
            "offload": config["offload"]["train"],
            "micro_batch_tokens": config["train"]["max_tokens_per_micro_batch"],
            "gaps": gaps,
            "max": max(known) if known else None,
            "passes": bool(known) and len(known) == len(gaps) and max(known) <= GATE,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--commit", default=None, help="The commit the runs ran (the device copy has no .git).")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    record = {
        "benchmark": "onpolicy_gap",
        "command": "pytest tests/gpu/test_onpolicy_qwen3_gpu.py; python " + " ".join(sys.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit,
        "hardware": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gate": GATE,
        "shapes": gaps_by_shape(args.root),
    }
    text = json.dumps(record, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
