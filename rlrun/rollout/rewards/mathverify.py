"""``rollout.reward: math_verify``: answers compared as mathematics by Hugging Face's math-verify (an extra:
``pip install math-verify``), where the ``math`` reward compares normalised strings and exact rationals.

The label is parsed as LaTeX (a label without ``$`` or ``\\boxed`` is wrapped in ``$...$``); the reply is
parsed as math-verify parses model output (its last ``\\boxed{}`` first, then other LaTeX and plain
expressions). Equal when sympy finds the two equal: ``\\pi/2 == \\frac{\\pi}{2}``, ``2\\sqrt{2} ==
\\sqrt{8}``, ``\\{1,2\\} == \\{2,1\\}``, ``50\\% == 0.5`` (the table: benchmarks/results/math_verify_table.md).

Each parse and the comparison stop after :data:`TIMEOUT_S` seconds (math-verify's alarm signal; a symbolic
simplification can run for minutes), which scores the sample 0 and counts it as a reward error. The alarm
works only in the main thread; elsewhere the limit is ``rollout.reward_timeout_s`` (a reward process).
"""

from __future__ import annotations

import threading

from rlrun.data.sample import Sample

TIMEOUT_S = 5
"""Per-sample limit (whole seconds, math-verify's alarm) on each parse and on the comparison."""


_WARM: list[bool] = []


def _warm_up(parse, verify, limit: int | None) -> None:
    """One untimed-by-the-sample comparison first: math-verify builds its LaTeX parser and imports sympy's
    printers lazily, seconds on a busy machine that must not count against the first sample's limit."""
    if not _WARM:
        verify(parse("$1$", parsing_timeout=limit and 20 * limit), parse("$1$"), timeout_seconds=limit and 20 * limit)
        _WARM.append(True)


def math_verify(sample: Sample) -> float:
    """1.0 when math-verify finds the reply's answer equal to the label, else 0.0 (a timeout raises)."""
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:
        raise RuntimeError(
            "rollout.reward math_verify needs the math-verify package; pip install math-verify (or rlrun[math])"
        ) from None
    limit = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    _warm_up(parse, verify, limit)
    label = str(sample.prompt.label)
    gold_text = label if "$" in label or "\\boxed" in label else f"${label}$"
    try:
        gold = parse(gold_text, parsing_timeout=limit, raise_on_error=True)
        answer = parse(sample.response_text, parsing_timeout=limit, raise_on_error=True)
        return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=limit, raise_on_error=True))
    except TimeoutException:
        raise TimeoutError(f"math-verify ran past {TIMEOUT_S} s on this sample") from None
