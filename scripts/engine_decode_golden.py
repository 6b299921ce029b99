"""Write (or check) the embedded engine's decode outputs on CPU fp32 for fixed seeds:
``tests/fixtures/engine_decode_golden.json``, which ``tests/unit/test_engine_decode_golden.py`` compares bitwise.

Why: a speed-up of the decode step (fewer copies, a skipped draw) must not change one token or one log-prob bit;
this pins the outputs of the code as it was before such changes. Regenerate only when a change is meant to move
numbers (a new torch release may too), and say so in the commit:

    PYTHONPATH=. python scripts/engine_decode_golden.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "engine_decode_golden.json"
PROMPTS = [[72, 101, 108, 108, 111], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW_TOKENS = 24
CALLS: dict[str, list[dict]] = {
    "greedy": [{"temperature": 0.0}] * 3,
    "top_p": [{"temperature": 1.0, "top_p": 0.95, "sampling_seed": 3, "n": 2}] * 3,
    "mixed": [  # greedy, unfiltered and filtering rows in one batch
        {"temperature": 0.0},
        {"temperature": 0.8, "sampling_seed": 4, "n": 2},
        {"temperature": 1.2, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "sampling_seed": 5, "n": 2},
    ],
}


def outputs(model_dir: Path) -> dict:
    """Per call: every row's output ids, log-probs (float.hex: bitwise) and a digest of its kept sets."""
    from rlrun.engine.backends.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, seed=0, dtype="float32", device="cpu")
    record = {}
    for name, params in CALLS.items():
        rows = engine.generate(PROMPTS, [{"max_new_tokens": NEW_TOKENS, "ignore_eos": True, **p} for p in params])
        record[name] = [
            {
                "output_ids": r["output_ids"],
                "output_logprobs": [float(x).hex() for x in r["output_logprobs"] or []],
                "kept_ids_sha256": hashlib.sha256(json.dumps(r.get("kept_ids")).encode()).hexdigest(),
            }
            for r in rows
        ]
    return record


def main() -> None:
    sys.path.insert(0, str(FIXTURE.parents[1]))
    from tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        record = outputs(make_tiny_model("qwen3", Path(tmp) / "qwen3"))
    if "--write" in sys.argv:
        FIXTURE.write_text(json.dumps(record) + "\n")
    else:
        print("equal" if json.loads(FIXTURE.read_text()) == record else "DIFFERENT")


if __name__ == "__main__":
    main()
