"""Finding the final answer in a reply and deciding whether two answers are the same.

Extraction: the last ``\\boxed{...}`` (or ``\\fbox{...}``, braces balanced) for math; the text after the
last ``####`` for GSM8K. Equality (:func:`answers_equal`) first normalises both sides (LaTeX spacing
and sizing commands, ``\\text{}`` wrappers, ``$``, degree and percent signs, ``\\dfrac`` / ``\\tfrac``,
a leading ``x =``, thousands separators, a trailing period) and then compares them as exact
rationals when both parse as numbers (``0.5 == 1/2 == \\frac{1}{2} == \\frac12``, ``-3 == \\frac{-6}{2}``),
else as normalised strings. Rationals are exact (``fractions.Fraction``), so ``1/3 != 0.333``.

For free-text answers (:func:`qa_tokens`): SQuAD's normalisation (lower case, no punctuation, no
articles, single spaces), split into words.
"""

from __future__ import annotations

import re
import string
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DROP = (
    "\\$",
    r"\left",
    r"\right",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\ ",
    "\\displaystyle",
    "$",
    "^\\circ",
    "^{\\circ}",
    "\\%",
    "%",
    "°",
)
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_ASSIGN = re.compile(r"^[a-zA-Z]\w*\s*=\s*(?=\S)")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or ``\\boxed 5``; None if none."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if start >= len(text):
        return None
    if text[start] != "{":
        token = re.match(r"[^\s$]+", text[start:])  # "\boxed 5" form
        return token.group() if token else None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return None  # unbalanced: the reply was cut off inside the box


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####``, else the last number in ``text`` (commas and signs kept)."""
    _, marker, tail = text.rpartition("####")
    found = _NUMBER.findall(tail if marker else text)
    if not found:
        return None
    return found[0] if marker else found[-1]


def normalize(answer: str) -> str:
    """A canonical string for ``answer`` (see the module docstring for what is removed)."""
    text = answer.strip()
    for _ in range(3):  # \text{} wrappers may nest
        text = _TEXT.sub(r"\1", text)
    for token in _DROP:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\sqrt\s*([0-9a-zA-Z])", r"\\sqrt{\1}", text)
    text = _fractions(text).replace("\u2212", "-")  # U+2212 is the typeset minus sign
    text = _ASSIGN.sub("", text.strip())
    text = _THOUSANDS.sub("", text)
    return "".join(text.split()).rstrip(".")


def _fractions(text: str) -> str:
    """Every ``\\frac{a}{b}`` (or ``\\frac12``; nested braces allowed) as ``a/b``, parenthesised when a
    side is not a plain number."""
    start = text.find("\\frac")
    if start < 0:
        return text
    pos, sides = start + len("\\frac"), []
    for _ in range(2):
        while pos < len(text) and text[pos].isspace():
            pos += 1
        side, pos = _argument(text, pos)
        if side is None:
            return text  # malformed (cut off): leave it for the string comparison
        side = _fractions(side).strip()
        sides.append(side if re.fullmatch(r"-?[\d.]+", side) else f"({side})")
    return text[:start] + f"{sides[0]}/{sides[1]}" + _fractions(text[pos:])


def _argument(text: str, pos: int) -> tuple[str | None, int]:
    """A LaTeX macro argument at ``pos``: a balanced ``{...}`` group or one character."""
    if pos >= len(text):
        return None, pos
    if text[pos] != "{":
        return text[pos], pos + 1
    depth = 0
    for i in range(pos, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[pos + 1 : i], i + 1
    return None, pos


def as_number(text: str) -> Fraction | None:
    """``text`` (already normalised) as an exact rational, or None when it is not a plain number / ratio."""
    sign = 1
    if text.startswith("-") and not text.startswith("--"):
        sign, text = -1, text[1:]
    text = text.removeprefix("+")
    parts = text.split("/")
    if len(parts) > 2 or not all(re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", p) for p in parts):
        return None
    value = Fraction(parts[0])
    if len(parts) == 2:
        denominator = Fraction(parts[1])
        if denominator == 0:
            return None
        value /= denominator
    return sign * value


def answers_equal(predicted: str | None, reference: object) -> bool:
    """True when ``predicted`` and ``reference`` are the same answer after normalisation."""
    if predicted is None:
        return False
    a, b = normalize(predicted), normalize(str(reference))
    if not a or not b:
        return False
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b


_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def qa_tokens(text: str) -> list[str]:
    """The words of ``text`` after SQuAD's answer normalisation: lower-cased, ASCII punctuation removed,
    then the articles a/an/the (``"The Eiffel-Tower!"`` -> ``["eiffeltower"]``)."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()
