"""Custom generate functions (``rollout.generate_fn``): multi-turn and tool-using rollouts.

A generate function is ``async def fn(traj: Trajectory) -> None | list[Sample]``. It is called once per response
(``samples_per_prompt`` times per prompt, concurrently) and drives the engine turn by turn::

    async def generate(traj):
        for _ in range(3):
            reply = await traj.generate()          # the model's tokens: trained on (loss mask 1)
            result = run_tool(reply)
            if result is None:
                return
            traj.append_message("tool", result)    # rendered by the tokenizer's chat template,
                                                   # context only (loss mask 0)

The trajectory becomes one :class:`Sample` whose ``response_ids`` are everything after the prompt
and whose ``loss_mask`` marks which of them the model generated. A trajectory may instead yield several
training samples (slime's generate functions returning a list): the function returns a list of samples,
typically ``traj.to_sample()`` and those of the contexts it opened with ``traj.fork(...)`` (a second agent,
a context reset after a summary)::

    async def generate(traj):
        await traj.generate()                                   # the solver's answer
        judge = traj.fork(judge_prompt(traj.tokenizer.decode(traj.response_ids)))
        await judge.generate()                                  # a second context, its own prompt
        return [traj.to_sample(), judge.to_sample()]            # two training samples, one trajectory

The reward scores the trajectory once, on its last sample (which sees the others in ``Sample.parts``), and
the group statistics count it once; each sample then trains with the trajectory's group score
(rlrun/rollout/train_samples.py). A trajectory never outgrows
``max_context_tokens`` (prompt + response): a turn gets at most the room left, environment text is
cut at the limit, and ``traj.generate()`` with no room left ends the trajectory (``finish_reason``
"length") by raising :class:`ContextFull`, which the driver catches. Engine calls from all concurrent
trajectories are batched: a call is sent when every unfinished trajectory is waiting for the engine
(or ``FLUSH_WAIT_S`` after the first request, when some are busy in an async tool).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from rlrun.agents.template import ChatTemplate
from rlrun.data.sample import Prompt, Sample
from rlrun.runtime.hooks import HookSpecError, resolve_hook

SIGNATURE = "async fn(traj: Trajectory) -> None | list[Sample]"
FLUSH_WAIT_S = 0.005
_SEED_STRIDE = 7919  # separates the seeds of one trajectory's turns
_FORK_SEED_STRIDE = 104_729  # separates the seeds of a trajectory's forks from its own turns


class ContextFull(Exception):
    """The trajectory reached ``max_context_tokens``; raised by ``generate`` to end it (caught by the driver)."""


def load_generate_fn(spec: str) -> Callable:
    """The ``async`` generate function named by ``rollout.generate_fn``; errors name the key and signature."""
    try:
        fn = resolve_hook(spec, num_args=1, allow_async=True)
    except HookSpecError as err:
        raise HookSpecError(
            f"rollout.generate_fn ('{spec}') must name a function with signature {SIGNATURE}, "
            f"but {err.reason}; set rollout.generate_fn to module:function or path/to/file.py:function"
        ) from None
    if not asyncio.iscoroutinefunction(fn):
        raise HookSpecError(
            f"rollout.generate_fn ('{spec}') must be an async def with signature {SIGNATURE} "
            "because trajectories run concurrently in one event loop; make it async"
        )
    return fn


class TurnBatcher:
    """Collects single-turn engine requests from concurrent trajectories into batched engine calls."""

    def __init__(self, engine, num_live: int):
        self.engine = engine
        self.live = num_live
        self.pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self.wakeup = asyncio.Event()
        self.all_waiting = asyncio.Event()

    async def generate(self, input_ids: list[int], params: dict) -> dict:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((input_ids, params, future))
        self._changed()
        return await future

    def finished(self) -> None:
        self.live -= 1
        self._changed()

    def _changed(self) -> None:
        self.wakeup.set()
        if self.pending and len(self.pending) >= self.live:
            self.all_waiting.set()

    async def serve(self) -> None:
        """Run until every trajectory has finished; engine errors fail every waiting trajectory."""
        while self.live > 0:
            await self.wakeup.wait()
            self.wakeup.clear()
            if not self.pending:
                continue
            try:
                await asyncio.wait_for(self.all_waiting.wait(), FLUSH_WAIT_S)
            except asyncio.TimeoutError:
                pass  # some trajectories are busy in a tool: send what is there
            batch, self.pending = self.pending, []
            self.all_waiting.clear()
            try:
                results = self.engine.generate(
                    [ids for ids, _, _ in batch], [p for _, p, _ in batch], return_logprob=True
                )
            except Exception as err:  # noqa: BLE001 - handed to the trajectories, which re-raise it
                results = [err] * len(batch)
            for (_, _, future), result in zip(batch, results, strict=False):
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)


@dataclass
class Trajectory:
    """One response being built turn by turn; the argument of a generate function.

    Read: ``prompt`` (with ``label``, ``metadata``, ``tools``), ``sample_index`` (0..n-1 in its
    group), ``tokenizer``, ``response_ids`` / ``loss_mask`` so far, ``finish_reason`` of the last turn.
    """

    prompt: Prompt
    sample_index: int
    tokenizer: Any
    sampling: dict
    """The run's sampling params (``rollout.*``); ``generate`` overrides ``n``, ``sampling_seed`` and,
    when asked, ``max_new_tokens``."""
    batcher: TurnBatcher
    seed: int
    max_context_tokens: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    matched_stop: str | int | None = None
    """What ended the last turn when it stopped: the stop string, or the EOS / stop token id."""
    weight_version: str = ""
    num_turns: int = 0
    skip_special_tokens: bool = True
    """``rollout.skip_special_tokens``: whether the text ``generate`` returns drops special tokens."""
    num_forks: int = 0
    """Contexts opened with :meth:`fork` so far (each gets its own seeds)."""
    after_model_turn: bool = False
    """Whether the last tokens appended are a model turn's (what :meth:`append_messages` must follow)."""
    chat_template: ChatTemplate | None = None
    """Renders :meth:`append_messages`' turns; None: the tokenizer's template, built on first use."""

    async def generate(
        self,
        max_new_tokens: int | None = None,
        stop: list[str] | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> str:
        """Let the model continue the prompt and everything appended so far; returns the new turn's text.

        Its tokens (ending with the stop token or the tokens that completed a stop string, when it
        stopped) are appended with loss mask 1. ``stop`` / ``stop_token_ids`` replace the run's
        ``rollout.stop`` / ``rollout.stop_token_ids`` for this turn only (e.g. ``stop=["</tool_call>"]``
        to hand control back at the end of a tool call); None keeps the run's. ``finish_reason`` then
        says "stop" and :attr:`matched_stop` which string or token id ended the turn.
        """
        room = self.max_context_tokens - len(self.prompt.prompt_ids) - len(self.response_ids)
        if room <= 0 and self.num_turns == 0:
            raise ValueError(
                f"prompt {self.prompt.index} ({len(self.prompt.prompt_ids)} tokens) must be shorter than "
                f"rollout.max_context_tokens ({self.max_context_tokens}) because the model needs room to "
                "answer; shorten the prompt or raise rollout.max_context_tokens"
            )
        if room <= 0:
            self.finish_reason = "length"
            raise ContextFull(f"prompt + response reached max_context_tokens ({self.max_context_tokens})")
        params = {**self.sampling, "n": 1, "sampling_seed": self.seed + _SEED_STRIDE * self.num_turns}
        params["max_new_tokens"] = min(room, max_new_tokens or params["max_new_tokens"])
        if stop is not None:
            params["stop"] = _check_stop(stop)
        if stop_token_ids is not None:
            params["stop_token_ids"] = [int(t) for t in stop_token_ids]
        result = await self.batcher.generate(self.prompt.prompt_ids + self.response_ids, params)
        self.num_turns += 1
        self.response_ids += result["output_ids"]
        self.loss_mask += [1] * len(result["output_ids"])
        self.logprobs += result["output_logprobs"]
        self.finish_reason = result["finish_reason"]["type"]
        self.matched_stop = result["finish_reason"].get("matched")
        self.weight_version = str(result.get("weight_version", ""))
        self.after_model_turn = True
        return self.tokenizer.decode(result["output_ids"], skip_special_tokens=self.skip_special_tokens)

    def append_message(self, role: str, content: str, **fields) -> list[int]:
        """Append one message (``role`` "tool" or "user"; ``fields`` such as ``tool_call_id`` or ``name`` go
        to the template) after the model's turn, rendered by the tokenizer's chat template together with the
        closing of that turn and the next generation prompt; loss mask 0. Returns the appended token ids."""
        return self.append_messages([{"role": role, "content": content, **fields}])

    def append_messages(self, messages: list[dict]) -> list[int]:
        """Append several messages after the model's turn in one rendering (templates such as Qwen's group
        consecutive tool results into one turn): the template's closing of the model's turn, the messages and
        the next generation prompt, with loss mask 0. Call it once between two :meth:`generate` calls."""
        if not self.after_model_turn:
            raise ValueError(
                "traj.append_messages() must follow traj.generate() because the template text it adds closes "
                "the model's turn and opens the next one; append a turn's messages in one call, after a "
                "model turn (or use traj.append_env for raw text)"
            )
        if self.chat_template is None:
            self.chat_template = ChatTemplate(self.tokenizer)
        last = self.response_ids[-1] if self.response_ids else None
        ids = self.chat_template.encode(self.chat_template.after_model_turn(messages, last, self.prompt.tools))
        self.append_env_ids(ids)
        return ids

    def append_env(self, text: str) -> list[int]:
        """Append tool / environment text (special tokens such as ``<|im_start|>`` are parsed) with loss
        mask 0; returns its token ids."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.append_env_ids(ids)
        return ids

    def append_env_ids(self, ids: list[int]) -> None:
        """Append already-tokenized environment tokens with loss mask 0 (and rollout log-prob 0), cut at
        ``max_context_tokens``."""
        room = self.max_context_tokens - len(self.prompt.prompt_ids) - len(self.response_ids)
        ids = list(ids)[: max(room, 0)]
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.after_model_turn = False

    def fork(self, prompt: str | list[int]) -> Trajectory:
        """A new context for the same row (its ``index``, ``label`` and ``metadata``) with ``prompt`` as its
        prompt: text (special tokens parsed, as in :meth:`append_env`; render the chat template yourself) or
        token ids. It generates through the same batched engine calls under its own seeds; return its
        :meth:`to_sample` in the list to train on it."""
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"] if isinstance(prompt, str) else prompt
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
        self.num_forks += 1
        return Trajectory(
            prompt=dataclasses.replace(self.prompt, prompt_ids=list(ids), prompt_text=text),
            sample_index=self.sample_index,
            tokenizer=self.tokenizer,
            sampling=self.sampling,
            batcher=self.batcher,
            seed=self.seed + _FORK_SEED_STRIDE * self.num_forks,
            max_context_tokens=self.max_context_tokens,
            skip_special_tokens=self.skip_special_tokens,
            chat_template=self.chat_template,
        )

    def to_sample(self) -> Sample:
        """The finished trajectory; ``response_text`` keeps special tokens so turns stay visible to rewards."""
        return Sample(
            group_index=self.prompt.index,
            prompt=self.prompt,
            response_ids=self.response_ids,
            response_text=self.tokenizer.decode(self.response_ids, skip_special_tokens=False),
            rollout_logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            loss_mask=self.loss_mask,
        )


def _check_stop(stop: list[str]) -> list[str]:
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(
            f"traj.generate(stop={stop!r}) must be a list of non-empty strings because each one ends the "
            "turn when the decoded text contains it; pass e.g. stop=['</tool_call>']"
        )
    return list(stop)


def run_generate_fn(
    fn: Callable,
    engine,
    prompts: list[Prompt],
    n: int,
    sampling: dict,
    seed: int,
    tokenizer,
    max_context_tokens: int,
    skip_special_tokens: bool = True,
) -> list[Sample]:
    """``n`` trajectories per prompt through ``fn``; samples come back prompt-major."""
    return asyncio.run(
        _run_all(fn, engine, prompts, n, sampling, seed, tokenizer, max_context_tokens, skip_special_tokens)
    )


async def _run_all(
    fn, engine, prompts, n, sampling, seed, tokenizer, max_context_tokens, skip_special_tokens
) -> list[Sample]:
    batcher = TurnBatcher(engine, num_live=len(prompts) * n)
    trajectories = [
        Trajectory(
            prompt=p,
            sample_index=j,
            tokenizer=tokenizer,
            sampling=sampling,
            batcher=batcher,
            seed=seed + 1_000_003 * j,
            max_context_tokens=max_context_tokens,
            skip_special_tokens=skip_special_tokens,
        )
        for p in prompts
        for j in range(n)
    ]

    async def drive(traj: Trajectory) -> Sample:
        returned = None
        try:
            returned = await fn(traj)
        except ContextFull:
            pass  # a normal end: the trajectory is as long as it may get
        except Exception as err:
            raise RuntimeError(
                f"rollout.generate_fn raised for prompt {traj.prompt.index} sample {traj.sample_index} "
                f"after {traj.num_turns} turns: {type(err).__name__}: {err}"
            ) from err
        finally:
            batcher.finished()
        if returned is None and traj.num_turns == 0:
            raise RuntimeError(
                f"rollout.generate_fn returned for prompt {traj.prompt.index} without calling "
                "traj.generate(); every trajectory needs at least one model turn"
            )
        return traj.to_sample() if returned is None else trajectory_of(returned, traj.prompt.index)

    server = asyncio.create_task(batcher.serve())
    try:
        return list(await asyncio.gather(*(drive(t) for t in trajectories)))
    finally:
        server.cancel()


def trajectory_of(parts: object, index: int) -> Sample:
    """The trajectory's sample for a generate function's returned list: a copy of its last sample holding
    the whole list as ``parts`` (a single sample is the trajectory itself)."""
    if not isinstance(parts, list) or not parts or not all(isinstance(p, Sample) for p in parts):
        raise TypeError(
            f"rollout.generate_fn returned {type(parts).__name__} for prompt {index}; it must return None or a "
            f"non-empty list of Sample (signature {SIGNATURE}) because each sample trains; return e.g. "
            "[traj.to_sample(), other.to_sample()]"
        )
    if any(p.group_index != index for p in parts):
        raise ValueError(
            f"rollout.generate_fn returned samples of prompts {sorted({p.group_index for p in parts})} for prompt "
            f"{index}; they must all be prompt {index}'s because they share its group; build them with "
            "traj.to_sample() and traj.fork(...)"
        )
    if len(parts) == 1:
        return parts[0]
    return dataclasses.replace(parts[-1], parts=list(parts))
