"""A label the reward cannot read, refused when the data is checked instead of scoring every sample 0.

verl's rows keep the answer inside an object (``reward_model: {ground_truth: "72", style: rule}``); with
``data.label_key: reward_model`` a built-in reward would compare the object's text with the reply and never
match. The first such row is refused with the dotted key that reaches the answer.
"""

from __future__ import annotations

from rlrun.data.prompt_files import PromptDataError, PromptRow
from rlrun.rollout.rewards.builtin import BUILTIN_REWARDS, LABEL_FREE

_ANSWER_KEYS = ("ground_truth", "answer", "label", "solution", "target")


def check_text_labels(rows: list[PromptRow], label_key: str | None, reward: str) -> None:
    """Raise naming the first row whose label is an object or list when ``reward`` is a built-in that
    compares text (user rewards may take structured labels)."""
    if label_key is None or reward not in BUILTIN_REWARDS or reward in LABEL_FREE:
        return
    for row in rows:
        if isinstance(row.label, (dict, list)):
            raise PromptDataError(
                f"{row.where}: data.label_key ({label_key}) holds {type(row.label).__name__} {_short(row.label)} "
                f"but rollout.reward ({reward}) compares the label as text, so every sample would score 0; "
                f"{_fix(label_key, row.label)}"
            )


def _fix(label_key: str, label: object) -> str:
    if isinstance(label, dict):
        keys = [k for k in _ANSWER_KEYS if k in label] or [k for k, v in label.items() if isinstance(v, (str, int))]
        if keys:
            return f"set data.label_key: {label_key}.{keys[0]}"
        return f"set data.label_key to the dotted key of the answer inside it (its keys: {sorted(label)})"
    return "set data.label_key to a key that holds the answer text, or use a reward of your own that reads a list"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
