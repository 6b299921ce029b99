"""Chat-template text for the turns an environment adds after a model turn, without re-rendering history.

A multi-turn sample keeps the model's sampled tokens as they were sampled; only what comes after them (the
rest of the assistant turn's closing, the new tool / user messages, the next generation prompt) is new text.
:class:`ChatTemplate` finds that text by rendering a probe conversation (a user turn and an assistant turn
holding a marker) with and without the new messages: what the template adds is the difference, and what it
puts after the marker is the assistant turn's closing (``<|im_end|>\\n`` for ChatML). The probe keeps the
earlier turns out of it, so a template that renders older assistant turns differently (Qwen3 drops their
reasoning) cannot change the tokens already sampled.
"""

from __future__ import annotations

from typing import Any

_MARK = "\u2063rlrun-probe\u2063"
_PROBE_HISTORY = ({"role": "user", "content": "probe"}, {"role": "assistant", "content": _MARK})


class TemplateError(ValueError):
    """The chat template does not render the new messages as an extension of the conversation so far."""


class ChatTemplate:
    """A tokenizer's chat template as the turns of a growing conversation (see the module docstring)."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        """The template's text of a whole conversation (``add_generation_prompt``: ending with the assistant header)."""
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            [_renderable(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (its special tokens parsed, no BOS added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The tokens of a conversation's first model turn: the whole rendering, ending with the generation prompt."""
        return self.encode(self.render(messages, tools))

    def after_model_turn(self, messages: list[dict], last_token_id: int | None, tools: list[dict] | None = None) -> str:
        """The text that follows a model turn's sampled tokens when ``messages`` (tool results, a user turn) come
        next: the closing of the assistant turn the model did not write itself, the messages, and the next
        generation prompt. ``last_token_id`` is the turn's last sampled token: when the closing starts with its
        text (the model ended on ``<|im_end|>``), that part is already there. Raises :class:`TemplateError`
        when the template does not render the messages as an extension."""
        if not messages:
            raise TemplateError("no messages to append after the model turn")
        base = self.render(list(_PROBE_HISTORY), tools, add_generation_prompt=False)
        full = self.render([*_PROBE_HISTORY, *messages], tools, add_generation_prompt=True)
        if not full.startswith(base) or _MARK not in base:
            raise TemplateError(
                "the chat template renders the conversation differently once new messages follow the assistant "
                "turn (its earlier text changes), so the turns cannot be appended as tokens"
            )
        closing = base[base.rindex(_MARK) + len(_MARK) :]
        if last_token_id is not None:
            last = self.tokenizer.decode([last_token_id], skip_special_tokens=False)
            if last and closing.startswith(last):
                closing = closing[len(last) :]
        return closing + full[len(base) :]


def _renderable(message: dict) -> dict:
    """A message as templates expect it: string content (None and content-part lists become text)."""
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return {**message, "content": content}
