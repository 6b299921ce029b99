"""Tool calls in a model's text, per template family: parsed into OpenAI ``tool_calls`` and rendered back.

A parser turns a model turn's text into (content, tool calls) and a list of tool calls back into the text the
model writes for them (for templates that do not render ``tool_calls`` themselves). One table,
:data:`TOOL_PARSERS`, names them (``rollout.agent_tool_parser``); a new family is one class and one row.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as a JSON object string (OpenAI's form)."""

    name: str
    arguments: str


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text without its tool calls, the calls in order); text without calls comes back whole."""
        ...

    def render(self, calls: list[ToolCall]) -> str:
        """The text a model of this family writes for ``calls``."""
        ...


class HermesParser:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, one call each.
    A block whose JSON does not parse, or lacks a string ``name``, stays in the content (the model's
    malformed call is text the agent sees)."""

    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls, kept, end = [], [], 0
        for match in self.BLOCK.finditer(text):
            call = _call_of(match.group(1))
            if call is None:
                continue
            kept.append(text[end : match.start()])
            end = match.end()
            calls.append(call)
        kept.append(text[end:])
        return ("".join(kept).strip() if calls else text), calls

    def render(self, calls: list[ToolCall]) -> str:
        blocks = [
            f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments or "{}"}}}\n</tool_call>'
            for c in calls
        ]
        return "\n".join(blocks)


def _call_of(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(data["name"], arguments)
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


TOOL_PARSERS: dict[str, ToolParser] = {"hermes": HermesParser()}
"""``rollout.agent_tool_parser`` value -> its parser."""
