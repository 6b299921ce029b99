"""Write the calculator task's prompts: ``python examples/calculator_tool/make_data.py [OUT_DIR]``.

Each row asks for ``a * b + c`` (two-digit times one- or two-digit, plus a small number): hard to do
in one's head for a 135M model, one calculator call with the tool. The prompt is a chat with one
worked demonstration of the tool protocol (SmolLM2-135M-Instruct does not call a tool it has only
been told about; with the demonstration it does in roughly one reply of five). Seeded, so the files
are stable.
"""

import json
import random
import sys
from pathlib import Path

DEMONSTRATION = [
    {
        "role": "system",
        "content": "You answer arithmetic questions with a calculator. Write <calc>expression</calc> to use it.",
    },
    {"role": "user", "content": "What is 12 * 7 + 5?"},
    {"role": "assistant", "content": "<calc>12 * 7 + 5</calc>"},
    {"role": "tool", "content": "89"},
    {"role": "assistant", "content": "89"},
]


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, c = rng.randint(11, 99), rng.randint(3, 39), rng.randint(1, 50)
        question = {"role": "user", "content": f"What is {a} * {b} + {c}?"}
        out.append({"prompt": DEMONSTRATION + [question], "label": a * b + c})
    return out


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", 256, 0), ("eval", 32, 1)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed)))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")
