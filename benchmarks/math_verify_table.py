"""The ``math_verify`` reward against the ``math`` reward on answer pairs: equivalent forms and wrong answers.

Each pair is (label, the reply's boxed answer, whether a mathematician calls them equal). Both rewards score a
reply ``The answer is \\boxed{<answer>}.`` against the label; the table has both verdicts. Prints JSON, then
a markdown table; ``--out DIR`` also writes both (math_verify_table.json / .md).

    python benchmarks/math_verify_table.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlrun.data.sample import Prompt, Sample  # noqa: E402
from rlrun.rollout.rewards.builtin import math_boxed  # noqa: E402
from rlrun.rollout.rewards.mathverify import math_verify  # noqa: E402

PAIRS: list[tuple[str, str, bool]] = [
    (r"\frac{\pi}{2}", r"\pi/2", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True),
    (r"\{1,2\}", r"\{2,1\}", True),
    ("1000", "1e3", True),
    ("1000", "10^3", True),
    ("0.5", r"\frac{1}{2}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    (r"\frac{\sqrt{3}}{2}", r"\sin(\pi/3)", True),
    ("50\\%", "0.5", True),
    (r"\ln(e^2)", "2", True),
    ("3", "3.0", True),
    ("1,000", "1000", True),
    (r"\dfrac{3}{4}", "0.75", True),
    ("x=3", "3", True),
    ("2", "3", False),
    (r"\frac{\pi}{2}", r"\pi", False),
    (r"2\sqrt{2}", r"\sqrt{2}", False),
    (r"\{1,2\}", r"\{1,3\}", False),
    ("1000", "1e4", False),
    ("(1,2)", "(2,1)", False),
]
"""(label, answer, equal): 14 equivalent forms, 6 wrong answers."""


def verdicts(label: str, answer: str) -> dict[str, bool]:
    prompt = Prompt(index=0, prompt_ids=[0], prompt_text="", label=label)
    sample = Sample(0, prompt, [0], f"The answer is $\\boxed{{{answer}}}$.", [0.0], "stop")
    return {"math_verify": math_verify(sample) == 1.0, "math": math_boxed(sample) == 1.0}


def table() -> list[dict]:
    return [
        {"label": label, "answer": answer, "equal": equal, **verdicts(label, answer)} for label, answer, equal in PAIRS
    ]


def markdown(rows: list[dict]) -> str:
    mark = {True: "yes", False: "no"}
    lines = ["| label | answer | equal | math_verify | math |", "|---|---|---|---|---|"]
    lines += [
        f"| `{r['label']}` | `{r['answer']}` | {mark[r['equal']]} | {mark[r['math_verify']]} | {mark[r['math']]} |"
        for r in rows
    ]
    for reward in ("math_verify", "math"):
        right = sum(r[reward] == r["equal"] for r in rows)
        lines.append(f"\n{reward}: {right} of {len(rows)} verdicts right")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for math_verify_table.json and .md")
    args = parser.parse_args()
    rows = table()
    text = json.dumps(rows, indent=1)
    print(text)
    print(markdown(rows))
    if args.out:
        (args.out / "math_verify_table.json").write_text(text + "\n")
        (args.out / "math_verify_table.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
