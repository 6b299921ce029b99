"""The OpenAI request bodies the agent server accepts, checked field by field.

A malformed field is a :class:`RequestError`, answered 400 with OpenAI's error body naming it (``param``).
Unknown fields are ignored (clients send ``user``, ``metadata``, ``stream_options`` and the like).
``temperature`` and ``top_p`` are checked, then the run's ``rollout.temperature`` / ``top_p`` sample: the
trained log-probs are the policy's at the temperature the trainer divides by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 64
MAX_STOP = 8


class RequestError(ValueError):
    """A request the server refuses: HTTP ``status``, the offending ``param`` and a message."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": None}}


@dataclass(frozen=True)
class Common:
    """The fields chat and text completions share."""

    n: int
    max_tokens: int | None
    stop: list[str] | None
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    parse_tools: bool
    """Whether tool calls are parsed out of the reply (tools given and ``tool_choice`` not "none")."""
    logprobs: bool
    common: Common


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    logprobs: bool
    common: Common


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "messages must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        _check_message(i, message)
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if not (choice in ("none", "auto", "required") or _is_named_choice(choice)):
        raise RequestError(
            "tool_choice", f"tool_choice ({choice!r}) must be 'none', 'auto', 'required' or a named function"
        )
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise RequestError("top_logprobs", "top_logprobs must be 0 or unset: the engine returns the sampled token's")
    return ChatRequest(
        messages=messages,
        tools=tools,
        parse_tools=bool(tools) and choice != "none",
        logprobs=_bool(body, "logprobs"),
        common=_common(body, ("max_completion_tokens", "max_tokens")),
    )


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    valid_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not valid_ids:
        raise RequestError("prompt", "prompt must be a non-empty string or list of token ids (one prompt per request)")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) and not isinstance(logprobs, bool):
        raise RequestError("logprobs", "logprobs must be 0, 1 or unset: the engine returns the sampled token's")
    if body.get("echo"):
        raise RequestError("echo", "echo must be false: the server returns only the completion")
    return CompletionRequest(prompt=prompt, logprobs=bool(logprobs), common=_common(body, ("max_tokens",)))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(None, "the request body must be a JSON object")
    return body


def _check_message(i: int, message: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(where, f"{where} must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"{where}.role ({role!r}) must be one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise RequestError(f"{where}.content", f"{where}.content is required (a string) for a {role} message")
    if content is not None and not isinstance(content, (str, list)):
        raise RequestError(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    calls = message.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls)
    ):
        raise RequestError(f"{where}.tool_calls", f"{where}.tool_calls must be a list of {{function: ...}} objects")


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "tools must be a list of {type: 'function', function: {name, ...}} objects")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}]", f"tools[{i}] must be {{type: 'function', function: {{name, ...}}}}")
    return tools or None


def _is_named_choice(choice: Any) -> bool:
    return isinstance(choice, dict) and isinstance(choice.get("function"), dict) and "name" in choice["function"]


def _common(body: dict, max_keys: tuple[str, ...]) -> Common:
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RequestError("n", f"n ({n!r}) must be an integer from 1 to {MAX_N}")
    max_tokens = None
    for key in max_keys:
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(key, f"{key} ({value!r}) must be a positive integer")
        max_tokens = value
        break
    _number(body, "temperature", 0.0, 2.0, low_open=False)
    _number(body, "top_p", 0.0, 1.0, low_open=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} of them")
    options = body.get("stream_options") or {}
    return Common(
        n=n,
        max_tokens=max_tokens,
        stop=stop or None,
        stream=_bool(body, "stream"),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
    )


def _number(body: dict, key: str, low: float, high: float, low_open: bool) -> None:
    value = body.get(key)
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value <= high
    ok = ok and (value > low if low_open else value >= low)
    if not ok:
        raise RequestError(key, f"{key} ({value!r}) must be a number in {'(' if low_open else '['}{low}, {high}]")


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(key, f"{key} ({value!r}) must be true or false")
    return value
