"""``rollout.agent``: run unchanged agent code against the rank's engine and train on what it sampled.

An agent is ``async def agent(client, row) -> float | dict | None``. ``client`` is an ``openai.AsyncOpenAI``
whose base URL is the agent's own session on this rank's :class:`AgentServer` (``client.base_url`` and
``client.api_key`` hand the same endpoint to a harness that starts its own process); ``row`` is the dataset
row as a dict (``prompt``, ``label``, ``metadata``, ``tools``, ``index``, ``sample_index``). Each response of a
group is one agent run, ``rollout.agent_concurrency`` at a time, each within ``rollout.agent_timeout_s``.

Its return is the reward (a number, or a dict of named scores with ``rollout.reward_key``) when
``rollout.agent_scores``; otherwise ``rollout.reward`` scores the session's sample. An agent that raises or
times out scores 0 with ``reward_error`` set (counted in ``rollout/reward_errors``, its message logged), and
the step goes on. The session's branches become the sample (several: its ``parts``), trained on the engine's
own tokens and log-probs (:mod:`rlrun.agents.sessions`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import uuid
from collections.abc import Callable
from pathlib import Path

from rlrun.agents.sessions import Session
from rlrun.agents.template import ChatTemplate
from rlrun.agents.tool_parsers import TOOL_PARSERS
from rlrun.config.schema import RolloutConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.runtime.hooks import HookSpecError, raised, resolve_hook

logger = logging.getLogger(__name__)
SIGNATURE = "async fn(client: openai.AsyncOpenAI, row: dict) -> float | dict | None"
_SESSION_SEED_STRIDE = 1_000_003


def load_agent(spec: str) -> Callable:
    """The ``async`` agent named by ``rollout.agent``; errors name the key and the signature."""
    try:
        fn = resolve_hook(spec, num_args=2, allow_async=True)
    except HookSpecError as err:
        raise HookSpecError(
            f"rollout.agent ('{spec}') must name a function with signature {SIGNATURE}, but {err.reason}; "
            "set rollout.agent to module:function or path/to/file.py:function"
        ) from None
    if not inspect.iscoroutinefunction(fn):
        raise HookSpecError(
            f"rollout.agent ('{spec}') must be an async def with signature {SIGNATURE} because agents run "
            "concurrently in one event loop beside their server; make it async"
        )
    return fn


def run_agents(
    fn: Callable,
    engine,
    prompts: list[Prompt],
    cfg: RolloutConfig,
    sampling: dict,
    seed: int,
    tokenizer,
    max_context_tokens: int,
    model_name: str = "policy",
) -> list[Sample]:
    """``samples_per_prompt`` agent runs per prompt; their samples come back prompt-major (scored when
    ``cfg.agent_scores``)."""
    return asyncio.run(_run(fn, engine, prompts, cfg, sampling, seed, tokenizer, max_context_tokens, model_name))


async def _run(fn, engine, prompts, cfg, sampling, seed, tokenizer, max_context_tokens, model_name) -> list[Sample]:
    import openai

    from rlrun.agents.server import AgentServer  # aiohttp: the agents extra, imported when agents run

    n = cfg.samples_per_prompt
    server = AgentServer(
        engine,
        tokenizer,
        TOOL_PARSERS[cfg.agent_tool_parser],
        sampling,
        max_context_tokens,
        model_name,
        concurrency=cfg.agent_concurrency,
    )
    template = ChatTemplate(tokenizer)
    gate = asyncio.Semaphore(cfg.agent_concurrency)

    async def one(k: int, prompt: Prompt, j: int) -> Sample:
        session = Session(f"{k}-{uuid.uuid4().hex[:12]}", prompt, seed + _SESSION_SEED_STRIDE * k, template)
        server.sessions[session.id] = session
        row = {
            "index": prompt.index,
            "sample_index": j,
            "prompt": prompt.prompt_text,
            "label": prompt.label,
            "metadata": prompt.metadata,
            "tools": prompt.tools,
        }
        returned, error = None, None
        async with gate:
            client = openai.AsyncOpenAI(base_url=server.base_url(session.id), api_key=server.token, max_retries=0)
            try:
                returned = await asyncio.wait_for(fn(client, row), cfg.agent_timeout_s)
            except asyncio.TimeoutError:
                error = f"agent timed out after rollout.agent_timeout_s ({cfg.agent_timeout_s} s)"
            except Exception as err:  # noqa: BLE001 - a user's agent may raise anything: it scores 0 and is counted
                error = f"agent raised {raised(err)}"
            finally:
                session.closed = True
                await client.close()
        sample = session.to_sample(tokenizer)
        _settle(sample, returned, error, cfg)
        return sample

    await server.start()
    try:
        samples = await asyncio.gather(*(one(i * n + j, p, j) for i, p in enumerate(prompts) for j in range(n)))
    finally:
        await server.stop()
    if server.engine_error is not None:
        raise RuntimeError(f"the engine failed while serving agents: {server.engine_error}") from server.engine_error
    _log_round(server.sessions.values(), samples)
    return list(samples)


def _settle(sample: Sample, returned, error: str | None, cfg: RolloutConfig) -> None:
    """Set the agent's reward (``agent_scores``) or its failure on the trajectory's sample."""
    if error is None and cfg.agent_scores:
        try:
            sample.reward, sample.reward_components = _agent_reward(returned, cfg.reward_key)
        except ValueError as err:
            error = f"agent returned an unusable reward: {err} (signature {SIGNATURE})"
    if error is not None:
        sample.reward, sample.reward_components, sample.reward_error = 0.0, None, error
    for part in sample.parts or []:
        part.reward, part.reward_error = sample.reward, sample.reward_error


def is_finite_reward(value: object) -> bool:
    """A finite real number other than a bool (what rewards are held to everywhere)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _agent_reward(value, reward_key: str | None) -> tuple[float, dict[str, float] | None]:
    """(the reward that trains, the named scores or None) of an agent's return value."""
    if is_finite_reward(value):
        return float(value), None
    if not isinstance(value, dict):
        raise ValueError(f"{value!r} is neither a finite number nor a dict of them")
    if reward_key is None or reward_key not in value:
        raise ValueError(f"dict {value!r} needs rollout.reward_key naming the score that trains")
    if not all(is_finite_reward(v) for v in value.values()):
        raise ValueError(f"dict {value!r} holds a value that is not a finite number")
    components = {str(k): float(v) for k, v in value.items()}
    return components[reward_key], components


def _log_round(sessions, samples: list[Sample]) -> None:
    sessions = list(sessions)
    turns = [t for s in sessions for t in s.prefill_tokens]
    failed = [s.reward_error for s in samples if s.reward_error and s.reward_error.startswith("agent ")]
    logger.info(
        "agents: %d sessions, %d requests, %d tool calls parsed, %d training samples, %d failed; prefill %d tokens "
        "(%d new since each branch's previous request; the engine prefilled %d, the rest from kept K/V)",
        len(sessions),
        len(turns),
        sum(s.num_tool_calls for s in sessions),
        sum(len(s.parts or [s]) for s in samples),
        len(failed),
        sum(t for t, _ in turns),
        sum(new for _, new in turns),
        sum(t for t, _ in turns) - sum(c for s in sessions for c in s.cached_tokens),
    )
    for message in sorted(set(failed)):
        logger.warning("agent failed for %d sample(s): %s", failed.count(message), message)


def model_name(path: str) -> str:
    """The model id the server reports: the model directory's name."""
    return Path(path).name or "policy"
