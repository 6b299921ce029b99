"""The embedded engine's decode on CPU fp32 for fixed seeds (greedy, top-p, and greedy / unfiltered / filtering
rows in one batch) gives bitwise the tokens, log-probs and kept sets recorded before the decode-step speed-ups
(``tests/fixtures/engine_decode_golden.json``, written by ``scripts/engine_decode_golden.py``)."""

from __future__ import annotations

import json

import pytest

from scripts.engine_decode_golden import FIXTURE, outputs

pytestmark = pytest.mark.slow  # loads a model


def test_decode_outputs_are_bitwise_the_recorded_ones(tiny_model_dirs):
    recorded = json.loads(FIXTURE.read_text())
    now = outputs(tiny_model_dirs["qwen3"])
    for call, rows in recorded.items():
        for k, (want, got) in enumerate(zip(rows, now[call], strict=True)):
            assert got == want, f"call {call}, row {k}"
