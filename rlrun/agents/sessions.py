"""Token-in-token-out sessions: what one agent's requests became, as the exact tokens the engine saw and sampled.

A session is one agent run (one response of a group). Its requests grow :class:`Branch` es, each a future
training sample: prompt tokens, then response tokens with a loss mask (1: sampled by the engine, with its
log-prob; 0: template, user and tool text). A request whose messages extend a branch's (the branch's last
turn is the assistant message the server returned) continues that branch: the earlier turns keep their
recorded tokens and only the new messages are rendered (:meth:`ChatTemplate.after_model_turn`), so a text
that would tokenize differently (an assistant turn sent back as text) never replaces what was sampled. Any
other request (history rewritten, a retry, a second context) starts a new branch from the template's
rendering of its messages. ``/v1/completions`` works the same on raw text or token ids.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from rlrun.agents.template import ChatTemplate, TemplateError
from rlrun.data.sample import Prompt, Sample

_SEED_STRIDE = 7919  # separates the seeds of one session's requests


def message_key(message: dict) -> tuple:
    """What makes two messages the same turn: role, text (stripped) and tool calls (name, parsed arguments)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "")
        try:
            arguments = json.dumps(json.loads(arguments), sort_keys=True)
        except (TypeError, ValueError):
            pass
        calls.append((function.get("name"), arguments))
    return message.get("role"), (content or "").strip(), tuple(calls)


@dataclass
class Branch:
    """One training sample in the making (see the module docstring)."""

    prompt_ids: list[int]
    tools: list[dict] | None = None
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    keys: list[tuple] | None = None
    """Chat: :func:`message_key` of every message so far, the returned assistant turn last; None: completions."""
    text: str | None = None
    """Completions on text: the exact text so far (prompt and completions); None otherwise."""
    num_turns: int = 0
    finish_reason: str = "stop"
    weight_version: str = ""
    busy: bool = False
    """A request on this branch is at the engine; another one that extends it gets a copy."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def copy(self) -> Branch:
        return dataclasses.replace(
            self,
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            keys=None if self.keys is None else list(self.keys),
            busy=False,
        )

    def append_context(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def append_sampled(self, result: dict) -> None:
        self.response_ids += result["output_ids"]
        self.loss_mask += [1] * len(result["output_ids"])
        self.logprobs += [float(x) for x in result["output_logprobs"]]
        self.finish_reason = result["finish_reason"]["type"]
        self.weight_version = str(result.get("weight_version", ""))
        self.num_turns += 1


@dataclass
class Turn:
    """A planned request: the branch it grows, the engine's input, and the input's tokens not yet prefilled by
    an earlier request of the branch (``new_tokens``: what a prefix-reusing engine would prefill)."""

    branch: Branch
    input_ids: list[int]
    context_ids: list[int]
    new_tokens: int


@dataclass
class Session:
    """One agent run's branches and counters; ``prompt`` is its dataset row."""

    id: str
    prompt: Prompt
    seed: int
    template: ChatTemplate
    branches: list[Branch] = field(default_factory=list)
    num_requests: int = 0
    num_tool_calls: int = 0
    prefill_tokens: list[tuple[int, int]] = field(default_factory=list)
    """Per request: (input tokens, of which new since the branch's previous request)."""
    cached_tokens: list[int] = field(default_factory=list)
    """Per request: input tokens the engine took from the branch's kept K/V instead of prefilling (embedded engine
    with ``session_cache_size``; 0 otherwise)."""
    closed: bool = False

    def next_seed(self) -> int:
        self.num_requests += 1
        return self.seed + _SEED_STRIDE * self.num_requests

    def plan_chat(self, messages: list[dict], tools: list[dict] | None) -> Turn:
        """The branch a chat request grows and the engine's input for it (see the module docstring)."""
        keys = [message_key(m) for m in messages]
        for branch in reversed(self.branches):
            known = branch.keys
            if known is None or branch.tools != tools or len(keys) <= len(known) or keys[: len(known)] != known:
                continue
            try:
                text = self.template.after_model_turn(messages[len(known) :], _last(branch), tools)
            except TemplateError:
                break
            return self._extend(branch, self.template.encode(text))
        return self._start(Branch(self.template.prompt_ids(messages, tools), tools=tools))

    def plan_completion(self, prompt: str | list[int]) -> Turn:
        """The branch a completions request grows: one whose text (or tokens) the prompt extends, else a new one."""
        for branch in reversed(self.branches):
            if branch.keys is not None:
                continue
            if isinstance(prompt, str) and branch.text is not None and prompt.startswith(branch.text):
                rest = prompt[len(branch.text) :]
                return self._extend(branch, self.template.encode(rest) if rest else [])
            if isinstance(prompt, list) and branch.text is None and prompt[: len(branch.ids)] == branch.ids:
                return self._extend(branch, prompt[len(branch.ids) :])
        if isinstance(prompt, str):
            return self._start(Branch(self.template.encode(prompt), text=""))
        return self._start(Branch(list(prompt)))

    def _extend(self, branch: Branch, context_ids: list[int]) -> Turn:
        if branch.busy:  # a concurrent request on the same history: it becomes its own sample
            branch = branch.copy()
            self.branches.append(branch)
        branch.busy = True
        # A cache kept from the branch's last request holds every token but the last sampled one (never forwarded).
        return Turn(branch, branch.ids + context_ids, context_ids, len(context_ids) + 1)

    def _start(self, branch: Branch) -> Turn:
        branch.busy = True
        self.branches.append(branch)
        return Turn(branch, branch.ids, [], len(branch.ids))

    def record(self, turn: Turn, results: list[dict], keys: list[list[tuple]] | None, texts: list[str] | None) -> None:
        """Grow the turn's branch with the first result and copies of it with the others (``n`` > 1);
        ``keys`` (chat) are each choice's conversation, ``texts`` (completions on text) each choice's text."""
        base = turn.branch.copy()
        self.prefill_tokens.append((len(turn.input_ids), turn.new_tokens))
        for i, result in enumerate(results):
            branch = turn.branch if i == 0 else base.copy()
            if i > 0:
                self.branches.append(branch)
            branch.append_context(turn.context_ids)
            branch.append_sampled(result)
            if keys is not None:
                branch.keys = keys[i]
            if texts is not None:
                branch.text = texts[i]
        turn.branch.busy = False

    def release(self, turn: Turn) -> None:
        """A turn that never reached the engine (refused, failed): its branch takes requests again."""
        turn.branch.busy = False
        if not turn.branch.num_turns and turn.branch in self.branches:
            self.branches.remove(turn.branch)

    def to_sample(self, tokenizer) -> Sample:
        """The session as its trajectory's sample: its branches with model turns, each a training sample (several
        become the ``parts`` of the last). A session without a model turn is one context token, masked, so the
        group stays whole."""
        samples = [self._sample(b, tokenizer) for b in self.branches if b.num_turns]
        if not samples:
            eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
            empty = Branch(list(self.prompt.prompt_ids), response_ids=[eos], loss_mask=[0], logprobs=[0.0])
            samples = [self._sample(empty, tokenizer)]
        # As a generate function's returned list (rlrun/rollout/multiturn.py): the last sample carries them all.
        return samples[0] if len(samples) == 1 else dataclasses.replace(samples[-1], parts=samples)

    def _sample(self, branch: Branch, tokenizer) -> Sample:
        prompt_text = tokenizer.decode(branch.prompt_ids, skip_special_tokens=False)
        return Sample(
            group_index=self.prompt.index,
            prompt=dataclasses.replace(self.prompt, prompt_ids=list(branch.prompt_ids), prompt_text=prompt_text),
            response_ids=list(branch.response_ids),
            response_text=tokenizer.decode(branch.response_ids, skip_special_tokens=False),
            rollout_logprobs=list(branch.logprobs),
            finish_reason=branch.finish_reason,
            weight_version=branch.weight_version,
            loss_mask=list(branch.loss_mask),
        )


def _last(branch: Branch) -> int | None:
    return branch.response_ids[-1] if branch.response_ids else None
