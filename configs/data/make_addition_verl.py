"""Write the quickstart's addition prompts in verl's parquet layout, the way verl's data scripts write rows:

    {"data_source": "addition", "prompt": [{"role": "user", "content": "What is 3 + 4? ..."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"split": "train", "index": 34, "a": 3, "b": 4}}

    python configs/data/make_addition_verl.py       # writes configs/data/addition_verl.parquet

The same 100 prompts as make_addition.py, in the same order; examples/verl_format/config.yaml trains on it
with a verl ``compute_score`` and no adapter.
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).with_name("addition_verl.parquet")
PROMPT = "What is {a} + {b}? Reply with only the number."


def verl_rows() -> list[dict]:
    return [
        {
            "data_source": "addition",
            "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": 10 * a + b, "a": a, "b": b},
        }
        for a in range(10)
        for b in range(10)
    ]


def write(path: Path = OUT) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    return path


if __name__ == "__main__":
    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
