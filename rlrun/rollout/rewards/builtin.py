"""Built-in rewards, selected by name in ``rollout.reward``.

``math`` / ``gsm8k`` / ``exact_match`` score correctness (1 or 0); ``format_boxed`` / ``format_think``
score only the shape of the reply, to be mixed into a custom reward; ``first_number`` is the
quickstart's shaped reward. ``dapo`` (+1 / -1), ``deepscaler`` (1 / 0) and ``f1`` (0..1) are slime's
``--rm-type`` rewards of those names; ``math_verify`` compares answers as mathematics (:mod:`.mathverify`).
Answer extraction and normalisation live in :mod:`.answers` (DAPO's own in :mod:`.minerva`).
"""

from __future__ import annotations

import re
from collections import Counter

from rlrun.data.sample import Sample
from rlrun.rollout.rewards.answers import answers_equal, gsm8k_answer, last_boxed, qa_tokens
from rlrun.rollout.rewards.mathverify import math_verify
from rlrun.rollout.rewards.minerva import dapo_answer, integer_label

_INTEGER = re.compile(r"-?\d+")
BREVITY_CHARS = 20
"""Extra characters (beyond the bare answer) at which ``first_number``'s brevity bonus reaches 0."""


def first_number(sample: Sample) -> float:
    """Shaped arithmetic reward of the quickstart's addition task::

        0                                                  if the first integer in the reply != label
        0.5 + 0.5 * max(0, 1 - (len(reply.strip()) - len(answer)) / 20)   if it ended on its own
        0.5                                                if it was cut off (finish_reason != "stop")

    The bonus is withheld from cut-off replies because a reply truncated at ``max_new_tokens`` looks
    short and would otherwise be rewarded for rambling. The label must be an integer (or its text).
    """
    answer = str(sample.prompt.label).strip()
    if not _INTEGER.fullmatch(answer):
        raise ValueError(f"first_number needs an integer label, got {sample.prompt.label!r}")
    reply = sample.response_text.strip()
    found = _INTEGER.search(reply)
    if found is None or int(found.group()) != int(answer):
        return 0.0
    if sample.finish_reason != "stop":
        return 0.5
    extra_chars = len(reply) - len(answer)
    return 0.5 + 0.5 * max(0.0, 1.0 - extra_chars / BREVITY_CHARS)


def exact_match(sample: Sample) -> float:
    """1.0 when the stripped reply equals the stripped label text, else 0.0."""
    return float(sample.response_text.strip() == str(sample.prompt.label).strip())


def math_boxed(sample: Sample) -> float:
    """1.0 when the reply's last ``\\boxed{}`` equals the label as an answer (``\\frac12 == 0.5``,
    ``1,000 == 1000``; see :func:`.answers.answers_equal`), else 0.0. A label that is itself a
    solution with a ``\\boxed{}`` is reduced to its boxed answer."""
    label = str(sample.prompt.label)
    return float(answers_equal(last_boxed(sample.response_text), last_boxed(label) or label))


def gsm8k(sample: Sample) -> float:
    """1.0 when the number after the reply's last ``####`` (else its last number) equals the label's
    (a GSM8K solution ``... #### 72`` or the bare answer), else 0.0."""
    label = str(sample.prompt.label)
    reference = gsm8k_answer(label) if "####" in label else label
    return float(answers_equal(gsm8k_answer(sample.response_text), reference))


_THINK = re.compile(r"\s*<think>(?P<thought>.*?)</think>(?P<answer>.*)", re.DOTALL)


def format_boxed(sample: Sample) -> float:
    """1.0 when the reply holds exactly one non-empty ``\\boxed{}`` answer, else 0.0."""
    boxes = sample.response_text.count("\\boxed")
    return float(boxes == 1 and bool((last_boxed(sample.response_text) or "").strip()))


def format_think(sample: Sample) -> float:
    """1.0 when the reply is ``<think>reasoning</think>`` followed by a non-empty answer (one think
    block, nothing before it), else 0.0."""
    match = _THINK.fullmatch(sample.response_text)
    return float(
        match is not None
        and bool(match["thought"].strip())
        and bool(match["answer"].strip())
        and "<think>" not in match["answer"]
    )


def dapo(sample: Sample) -> float:
    """slime's ``--rm-type dapo`` (DAPO's math verifier): +1.0 when the text after the last ``Answer:``
    in the reply's last 300 characters, normalised (:mod:`.minerva`: ``$``, ``\\boxed{}``, units, a
    leading ``x =`` and thousands commas removed), is the integer label's digits; -1.0 otherwise,
    including a reply with no ``Answer:`` line. Only an integral label is accepted (slime truncates
    ``2.5`` to ``2``; rlrun raises, so the row scores 0 and is counted in ``rollout/reward_errors``)."""
    return 1.0 if dapo_answer(sample.response_text) == integer_label(sample.prompt.label) else -1.0


def deepscaler(sample: Sample) -> float:
    """slime's ``--rm-type deepscaler`` (DeepScaleR's rule reward): 1.0 when the last ``\\boxed{}`` of the
    solution equals the label (a label with a box is reduced to its boxed answer), else 0.0. The solution
    is the text after the last ``</think>``, else the text between the first and second ``###Response``;
    a reply with neither (unfinished reasoning) scores 0.0, as does an empty label. Equality is
    :func:`.answers.answers_equal` (exact rationals, normalised strings), not slime's sympy
    simplification: symbolically equal forms such as ``\\sqrt{8}`` and ``2\\sqrt{2}`` do not match."""
    reply, label = sample.response_text, str(sample.prompt.label)
    if "</think>" in reply:
        solution = reply.rpartition("</think>")[2]
    elif "###Response" in reply:
        solution = reply.split("###Response")[1]
    else:
        return 0.0
    reference = last_boxed(label) if "\\boxed" in label or "\\fbox" in label else label
    if not reference:
        return 0.0
    return float(answers_equal(last_boxed(solution), reference))


YES_NO = ("yes", "no", "noanswer")
"""Answers that are right or wrong as a whole: a partial word overlap with them earns nothing (HotpotQA)."""


def f1(sample: Sample) -> float:
    """slime's ``--rm-type f1``: the token F1 between the reply and the label (SQuAD / HotpotQA)::

        p = common / len(reply_tokens),  r = common / len(label_tokens),  f1 = 2 p r / (p + r)

    over the words :func:`.answers.qa_tokens` keeps (lower case, no punctuation, no articles), ``common``
    counting repeated words as often as both sides have them. 0.0 when nothing is shared (an empty reply),
    and when either side normalises to yes / no / noanswer and the two differ."""
    reply, label = qa_tokens(sample.response_text), qa_tokens(str(sample.prompt.label))
    if (" ".join(reply) in YES_NO or " ".join(label) in YES_NO) and reply != label:
        return 0.0
    common = sum((Counter(reply) & Counter(label)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(reply), common / len(label)
    return 2 * precision * recall / (precision + recall)


BUILTIN_REWARDS = {
    "first_number": first_number,
    "exact_match": exact_match,
    "math": math_boxed,
    "gsm8k": gsm8k,
    "format_boxed": format_boxed,
    "format_think": format_think,
    "dapo": dapo,
    "deepscaler": deepscaler,
    "f1": f1,
    "math_verify": math_verify,
}

LABEL_FREE = frozenset({"format_boxed", "format_think"})
"""Built-ins that do not read the label; every other one compares it as text."""
