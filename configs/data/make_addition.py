"""Write the quickstart's addition prompts: every pair a, b in 0..9 once, in a fixed order.

    python configs/data/make_addition.py            # rewrites configs/data/addition_train.jsonl

Deterministic (no randomness; the sampler shuffles per epoch), so the committed file can be checked
against this generator. The prompt asks for only the number: the reward's brevity bonus (``first_number``)
pays for that.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPT = "What is {a} + {b}? Reply with only the number."
OUT = Path(__file__).with_name("addition_train.jsonl")


def addition_rows() -> list[dict]:
    return [{"prompt": PROMPT.format(a=a, b=b), "label": a + b} for a in range(10) for b in range(10)]


def write(path: Path = OUT) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in addition_rows()))
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
