"""Prompt datasets (jsonl or parquet rows, tokenized) and the deterministic, resumable sampler.

Rows are read and checked by :mod:`rlrun.data.prompt_files` (keys, ``path@[start:end]`` slices,
``file:line`` errors); this module turns them into tokenized :class:`Prompt` s when the dataset is
built, so a malformed row fails before training.

Chat templates and system turns: ``data.system_prompt`` None means *no* system turn. Some templates
(SmolLM2's, Qwen2.5's) insert a default system turn when the conversation has none, which would
change the prompt the user asked for (SmolLM2: 45 tokens instead of 24). When the template does
that and it is ChatML (checked by rendering a conversation *with* a system turn both ways and
comparing), the turns are rendered here as ChatML instead; other templates that insert a default
system turn are refused with an error asking for an explicit ``data.system_prompt``. Rows with tools
always go through the template (only it knows how to render tool schemas).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from rlrun.config.schema import DataConfig
from rlrun.data.prompt_files import Messages, PromptDataError, PromptRow, read_rows
from rlrun.data.sample import Prompt

__all__ = ["ChatRenderer", "PromptDataError", "PromptDataset", "PromptSampler", "read_rows", "render_chatml"]
_PROBE = "\x00rlrun-probe\x00"


class PromptDataset:
    """The rows ``cfg.path`` selects, tokenized once when constructed (a bad row fails here, before training)."""

    def __init__(self, cfg: DataConfig, tokenizer):
        rows = read_rows(cfg.path, cfg.prompt_key, cfg.label_key, cfg.metadata_key, cfg.tools_key, cfg.split)
        render = (
            ChatRenderer(tokenizer, cfg.system_prompt, cfg.chat_template_kwargs) if cfg.apply_chat_template else None
        )
        self.source = cfg.path
        self.prompts = [_tokenize(row, render, tokenizer, cfg.prompt_key) for row in rows]
        self.fingerprint = _fingerprint(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


def _fingerprint(prompts: list[Prompt]) -> str:
    """A short hash of every prompt's token ids and label: equal iff the data the run sees is equal."""
    digest = hashlib.blake2b(digest_size=8)
    for prompt in prompts:
        digest.update(repr((prompt.prompt_ids, prompt.label)).encode())
    return digest.hexdigest()


def _tokenize(row: PromptRow, render: ChatRenderer | None, tokenizer, prompt_key: str) -> Prompt:
    if render is not None:
        text = render(row.prompt, row.tools)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template placed BOS
    elif isinstance(row.prompt, str):
        text = row.prompt
        ids = tokenizer(text)["input_ids"]
    else:
        raise PromptDataError(
            f"{row.where}: '{prompt_key}' is a list of chat messages but "
            "data.apply_chat_template is false; set data.apply_chat_template: true"
        )
    return Prompt(
        index=row.index, prompt_ids=list(ids), prompt_text=text, label=row.label, metadata=row.metadata, tools=row.tools
    )


class ChatRenderer:
    """Renders a prompt (text or messages) as the text the model sees, ending with the assistant header.

    ``template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``enable_thinking: false``).
    """

    def __init__(self, tokenizer, system_prompt: str | None, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self.own_chatml = system_prompt is None and _injects_default_system(tokenizer, self.template_kwargs)
        if self.own_chatml and not _is_chatml(tokenizer, self.template_kwargs):
            raise PromptDataError(
                f"data.system_prompt (None) must be set for {type(tokenizer).__name__} "
                f"'{getattr(tokenizer, 'name_or_path', '')}' because its chat template inserts a default "
                "system turn that rlrun can only leave out for ChatML templates; set data.system_prompt"
            )

    def __call__(self, prompt: str | Messages, tools: list[dict] | None = None) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        has_system = messages[0]["role"] == "system"
        if self.system_prompt is not None and not has_system:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if self.own_chatml and not has_system and not tools:
            return render_chatml(messages)
        return _apply_template(self.tokenizer, messages, self.template_kwargs, tools)


def render_chatml(messages: Messages) -> str:
    """ChatML turns plus the assistant generation header, exactly as ChatML templates render them."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def _apply_template(tokenizer, messages: Messages, kwargs: dict[str, Any], tools: list[dict] | None = None) -> str:
    if tools:
        kwargs = {**kwargs, "tools": tools}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def _injects_default_system(tokenizer, kwargs: dict[str, Any]) -> bool:
    """True when a user-only conversation renders with a system turn the user did not write."""
    rendered = _apply_template(tokenizer, [{"role": "user", "content": _PROBE}], kwargs)
    return "system" in rendered.replace(_PROBE, "")


def _is_chatml(tokenizer, kwargs: dict[str, Any]) -> bool:
    """True when the template renders an explicit system + user conversation exactly as ChatML."""
    messages = [{"role": "system", "content": _PROBE + "s"}, {"role": "user", "content": _PROBE + "u"}]
    return _apply_template(tokenizer, messages, kwargs) == render_chatml(messages)


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

    def state_dict(self) -> dict[str, Any]:
        """The cursor (epoch, position) plus what identifies the data, for checkpoints (JSON-safe)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_prompts": len(self.dataset),
            "fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_prompts"] != len(self.dataset):
            raise ValueError(
                f"sampler state has num_prompts ({state['num_prompts']}) but the dataset has {len(self.dataset)} "
                "rows; resuming needs the same prompt file (data.path) as the checkpointed run"
            )
        if state["fingerprint"] != self.dataset.fingerprint:
            raise ValueError(
                f"sampler state fingerprint ({state['fingerprint']}) must match the dataset's "
                f"({self.dataset.fingerprint}) because resuming on changed rows would skip or repeat prompts; "
                "set data.path (and its tokenizer / template settings) as in the checkpointed run"
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
