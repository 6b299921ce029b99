"""DAPO's answer check: the text after the last ``Answer:``, normalised the Minerva way, against an integer.

DAPO-Math-17k asks for "Answer: $Answer" on the last line and all its answers are integers, so the
check is a string comparison after a normalisation that strips what models wrap around a number:
``$...$``, ``\\boxed{}`` / ``\\text{}`` / ``\\textbf{}`` / ``\\overline{}`` wrappers, a leading ``x =``,
spaces, unit words ("dollars", "cm", ...), degree marks and thousands commas. Behaviour follows slime's
``rm_hub/math_dapo_utils.py`` (itself after lm-evaluation-harness's Minerva MATH normaliser), so
``42.0`` or ``\\frac{84}{2}`` do not equal ``42``: the model is asked for the integer.
"""

from __future__ import annotations

import math
import re

TAIL_CHARS = 300
"""Only the reply's last characters are searched (slime's cut; the longest MATH-500 answer is 159)."""

ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
NO_ANSWER = "[INVALID]"
"""What a reply without an ``Answer:`` line is compared as: no integer label normalises to it."""

# Applied in order: first the rewrites, then the deletions (the order matters: "\text{m}" becomes
# "\text{}", which a deletion removes; "an " goes before "a ", and both before spaces).
_REWRITES = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_UNITS = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes digits cents "
    "degrees cm gm pounds meters meals edges students childrentickets multiples"
).split()
_DELETIONS = (
    *_UNITS,
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
    "<|im_end|>",
    "<|endoftext|>",
)
_UNWRAP = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # a line's first $...$ span alone
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the last brace
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt3 -> \sqrt{3}
)


def normalize_final_answer(answer: str) -> str:
    """``answer`` as DAPO compares it (see the module docstring)."""
    text = answer.split("=")[-1]
    for old, new in _REWRITES:
        text = text.replace(old, new)
    for token in _DELETIONS:
        text = text.replace(token, "")
    for pattern, replacement in _UNWRAP:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_answer(reply: str) -> str:
    """The normalised text after the last ``Answer:`` in the reply's tail, or ``NO_ANSWER``."""
    found = ANSWER_LINE.findall(reply[-TAIL_CHARS:])
    return normalize_final_answer(found[-1]) if found else NO_ANSWER


def integer_label(label: object) -> str:
    """The label as the integer string a correct answer must equal; raises for a non-integer label."""
    text = normalize_final_answer(str(label))
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not value.is_integer():
        raise ValueError(f"dapo needs an integer label (DAPO-Math answers are integers), got {label!r}")
    return str(int(value))
