"""jsonl prompt datasets and the deterministic, resumable sampler that draws from them.

Each line is a JSON object with ``data.prompt_key`` (a string, or a list of ``{"role", "content"}``
chat messages) and ``data.label_key`` (any JSON value, handed to the reward). Other keys are kept as
``Prompt.metadata``. Every row is parsed, checked and tokenized when the dataset is loaded, so a
malformed line fails before training with ``file:line`` in the message.

Chat templates and system turns: ``data.system_prompt`` None means *no* system turn. Some templates
(SmolLM2's, Qwen2.5's) insert a default system turn when the conversation has none, which would
change the prompt the user asked for (SmolLM2: 45 tokens instead of 24). When the template does
that and it is ChatML (checked by rendering a conversation *with* a system turn both ways and
comparing), the turns are rendered here as ChatML instead; other templates that insert a default
system turn are refused with an error asking for an explicit ``data.system_prompt``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlrun.config.schema import DataConfig
from rlrun.data.sample import Prompt

Messages = list[dict[str, str]]
_PROBE = "\x00rlrun-probe\x00"


class PromptDataError(ValueError):
    """A prompt file or row the user must fix; the message names the file and line."""


@dataclass(frozen=True)
class PromptRow:
    """One checked jsonl row before tokenization. ``line`` is 1-based, for error messages."""

    index: int
    line: int
    prompt: str | Messages
    label: Any
    metadata: dict[str, Any]


def read_rows(path: str | Path, prompt_key: str = "prompt", label_key: str = "label") -> list[PromptRow]:
    """Parse and check every row of a jsonl prompt file (no tokenizer needed; cheap)."""
    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"{path}: prompt file not found (cwd {Path.cwd()}); set data.path")
    rows: list[PromptRow] = []
    with path.open(encoding="utf-8") as lines:
        for line_no, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            rows.append(_parse_row(path, line_no, text, len(rows), prompt_key, label_key))
    if not rows:
        raise PromptDataError(f"{path}: no prompts (the file is empty); set data.path to a jsonl file with rows")
    return rows


def _parse_row(path: Path, line_no: int, text: str, index: int, prompt_key: str, label_key: str) -> PromptRow:
    where = f"{path}:{line_no}"
    try:
        row = json.loads(text.rstrip())
    except json.JSONDecodeError as err:
        raise PromptDataError(f"{where}: invalid JSON ({err.msg} at column {err.pos + 1})") from None
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    for key, field in ((prompt_key, "data.prompt_key"), (label_key, "data.label_key")):
        if key not in row:
            raise PromptDataError(f"{where}: missing key '{key}' ({field}); the row has keys {sorted(row)}")
    prompt = row[prompt_key]
    if not _is_prompt(prompt):
        raise PromptDataError(
            f"{where}: '{prompt_key}' ({_short(prompt)}) must be a non-empty string or a non-empty list of "
            '{"role": str, "content": str} messages'
        )
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, label_key)}
    return PromptRow(index=index, line=line_no, prompt=prompt, label=row[label_key], metadata=metadata)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and set(m) >= {"role", "content"}
            and isinstance(m["role"], str) and isinstance(m["content"], str)
            for m in value
        )
    )


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class PromptDataset:
    """All rows of ``cfg.path``, tokenized once when constructed (a bad row fails here, before training)."""

    def __init__(self, cfg: DataConfig, tokenizer):
        rows = read_rows(cfg.path, cfg.prompt_key, cfg.label_key)
        render = ChatRenderer(tokenizer, cfg.system_prompt) if cfg.apply_chat_template else None
        self.prompts: list[Prompt] = []
        for row in rows:
            if render is not None:
                text = render(row.prompt)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template placed BOS
            elif isinstance(row.prompt, str):
                text = row.prompt
                ids = tokenizer(text)["input_ids"]
            else:
                raise PromptDataError(
                    f"{cfg.path}:{row.line}: '{cfg.prompt_key}' is a list of chat messages but "
                    "data.apply_chat_template is false; set data.apply_chat_template: true"
                )
            self.prompts.append(Prompt(index=row.index, prompt_ids=list(ids), prompt_text=text,
                                       label=row.label, metadata=row.metadata))

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


class ChatRenderer:
    """Renders a prompt (text or messages) as the text the model sees, ending with the assistant header."""

    def __init__(self, tokenizer, system_prompt: str | None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.own_chatml = system_prompt is None and _injects_default_system(tokenizer)
        if self.own_chatml and not _is_chatml(tokenizer):
            raise PromptDataError(
                f"data.system_prompt (None) must be set for {type(tokenizer).__name__} "
                f"'{getattr(tokenizer, 'name_or_path', '')}' because its chat template inserts a default "
                "system turn that rlrun can only leave out for ChatML templates; set data.system_prompt"
            )

    def __call__(self, prompt: str | Messages) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        has_system = messages[0]["role"] == "system"
        if self.system_prompt is not None and not has_system:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.own_chatml and not has_system:
            return render_chatml(messages)
        return _apply_template(self.tokenizer, messages)


def render_chatml(messages: Messages) -> str:
    """ChatML turns plus the assistant generation header, exactly as ChatML templates render them."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _apply_template(tokenizer, messages: Messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _injects_default_system(tokenizer) -> bool:
    """True when a user-only conversation renders with a system turn the user did not write."""
    rendered = _apply_template(tokenizer, [{"role": "user", "content": _PROBE}])
    return "system" in rendered.replace(_PROBE, "")


def _is_chatml(tokenizer) -> bool:
    """True when the template renders an explicit system + user conversation exactly as ChatML."""
    messages = [{"role": "system", "content": _PROBE + "s"}, {"role": "user", "content": _PROBE + "u"}]
    return _apply_template(tokenizer, messages) == render_chatml(messages)


class PromptSampler:
    """Deterministic, resumable prompt order: epoch ``e`` is a shuffle seeded with ``seed + e``.

    ``next_batch(n)`` continues into the next epoch when the current one runs out, so every prompt
    is drawn exactly once per epoch. ``state_dict()`` is the (epoch, position) cursor; restoring it
    continues the exact sequence, so a resumed run neither drops nor repeats prompts.
    """

    def __init__(self, dataset: PromptDataset, seed: int, shuffle: bool = True):
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def next_batch(self, n: int) -> list[Prompt]:
        batch = []
        while len(batch) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            take = self._order[self.position : self.position + n - len(batch)]
            batch.extend(self.dataset[i] for i in take)
            self.position += len(take)
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_prompts"] != len(self.dataset):
            raise ValueError(
                f"sampler state has num_prompts ({state['num_prompts']}) but the dataset has {len(self.dataset)} "
                "rows; resuming needs the same prompt file (data.path) as the checkpointed run"
            )
        if not 0 <= state["position"] <= len(self.dataset):
            raise ValueError(f"sampler position ({state['position']}) must be in [0, {len(self.dataset)}]")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order
