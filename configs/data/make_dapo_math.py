"""Convert DAPO-Math-17k (or any parquet/jsonl in its shape) into rlrun prompt rows ``{prompt, label}``.

    python configs/data/make_dapo_math.py data/dapo-math-17k/data/dapo-math-17k.parquet data/dapo_math.jsonl

A DAPO row holds ``prompt: [{"role": "user", "content": ...}]`` whose content wraps the problem in an
instruction to end with ``Answer: $Answer``, and ``reward_model: {"ground_truth": ...}``. The problem
is kept, the instruction is replaced by one asking for ``\\boxed{}`` (what rlrun's ``math`` reward
reads), and the ground truth becomes the label. Duplicate problems (the published file repeats
each one many times) are written once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DAPO_PREFIX = "Solve the following math problem step by step."
DAPO_SUFFIX = 'Remember to put your answer on its own line after "Answer:".'
INSTRUCTION = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def problem_text(content: str) -> str:
    """The problem inside DAPO's instruction (content without it is returned as is)."""
    parts = content.strip().split("\n\n")
    if len(parts) >= 3 and parts[0].startswith(DAPO_PREFIX) and parts[-1].strip() == DAPO_SUFFIX:
        return "\n\n".join(parts[1:-1]).strip()
    return content.strip()


def convert_row(row: dict) -> dict:
    prompt = row["prompt"]
    content = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
    return {
        "prompt": INSTRUCTION.format(problem=problem_text(content)),
        "label": str(row["reward_model"]["ground_truth"]),
    }


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def convert(src: Path, dst: Path) -> int:
    rows = {}
    for row in map(convert_row, read_rows(src)):
        rows.setdefault(row["prompt"], row)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    return len(rows)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"{convert(Path(sys.argv[1]), Path(sys.argv[2]))} prompts -> {sys.argv[2]}")
