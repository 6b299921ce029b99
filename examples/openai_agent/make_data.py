"""Write the agent's task rows: ``python examples/openai_agent/make_data.py [OUT_DIR]``.

Each row is a plain question (the agent builds its own chat) and its integer answer: ``a * b + c``, hard for a
135M model in its head, one calculator call with the tool. Seeded, so the files are stable.
"""

import json
import random
import sys
from pathlib import Path


def rows(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, c = rng.randint(11, 99), rng.randint(3, 39), rng.randint(1, 50)
        out.append({"prompt": f"What is {a} * {b} + {c}?", "label": a * b + c})
    return out


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", 256, 0), ("eval", 32, 1)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(count, seed)))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")
