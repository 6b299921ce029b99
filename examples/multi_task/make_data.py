"""Write the multi-task prompt file: ``python examples/multi_task/make_data.py [OUT_FILE]``.

Interleaves the 100 addition rows of configs/data/addition_train.jsonl (plain questions, single-turn
answers) with the first 100 calculator rows of examples/calculator_tool/data/train.jsonl (chats with a
worked tool call), each row tagged with its data source and reward type in two extra keys, which
``data.metadata_key: null`` makes the row's metadata::

    {"prompt": "What is 3 + 4? ...", "label": 7, "source": "addition", "reward_type": "add"}
    {"prompt": [...chat...], "label": 1141, "source": "calculator", "reward_type": "calc"}
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = (
    (REPO / "configs/data/addition_train.jsonl", "addition", "add"),
    (REPO / "examples/calculator_tool/data/train.jsonl", "calculator", "calc"),
)
ROWS_PER_SOURCE = 100


def main(out: Path) -> None:
    tagged = []
    for path, source, reward_type in SOURCES:
        rows = [json.loads(line) for line in path.read_text().splitlines()][:ROWS_PER_SOURCE]
        tagged.append([{**row, "source": source, "reward_type": reward_type} for row in rows])
    mixed = [row for pair in zip(*tagged, strict=True) for row in pair]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in mixed))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data/train.jsonl")
