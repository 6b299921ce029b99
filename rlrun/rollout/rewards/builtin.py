"""Built-in rewards, selected by name in ``rollout.reward``."""

from __future__ import annotations

import re

from rlrun.data.sample import Sample

_INTEGER = re.compile(r"-?\d+")
BREVITY_CHARS = 20
"""Extra characters (beyond the bare answer) at which ``first_number``'s brevity bonus reaches 0."""


def first_number(sample: Sample) -> float:
    """Shaped arithmetic reward (shared/reference/quickstart-task.md)::

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


BUILTIN_REWARDS = {"first_number": first_number, "exact_match": exact_match}
