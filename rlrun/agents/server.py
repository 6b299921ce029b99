"""The OpenAI-compatible HTTP API a rank serves to its agents while a rollout runs.

Routes, under ``http://127.0.0.1:PORT/s/<session>/v1`` (the base URL an agent's client gets):
``POST /chat/completions`` (streamed or not), ``POST /completions``, ``GET /models``. Every request needs
``Authorization: Bearer <token>``, the run's per-rollout secret (401 otherwise); the session id in the path picks
the agent's own :class:`Session` (404 for one that is not open), so no request touches another agent's tokens.
A request is rendered to token ids (:mod:`rlrun.agents.sessions`), sent to the engine as its own ``generate``
call from a thread pool (the engine batches calls that are in flight together: a request joins the running
batch as it arrives, whatever the other agents are doing), and recorded with the engine's ids and log-probs.
Streaming sends the finished turn as server-sent events: the engine answers whole turns.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from aiohttp import web

from rlrun.agents.requests import ChatRequest, RequestError, parse_chat, parse_completion
from rlrun.agents.sessions import Session, Turn, message_key
from rlrun.agents.tool_parsers import ToolParser


class AgentServer:
    """One rollout round's HTTP endpoint on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        engine,
        tokenizer,
        parser: ToolParser,
        sampling: dict,
        max_context_tokens: int,
        model_name: str,
        concurrency: int,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.parser = parser
        self.sampling = sampling
        """The run's engine sampling params; a request sets ``n``, ``max_new_tokens``, ``stop`` and the seed."""
        self.max_context_tokens = max_context_tokens
        self.model_name = model_name
        self.token = secrets.token_urlsafe(24)
        self.sessions: dict[str, Session] = {}
        self.engine_error: BaseException | None = None
        """The first engine failure: the agents see a 500, the rollout re-raises it once they end."""
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="agent-engine")
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 2**20)
        app.add_routes(
            [
                web.get("/s/{session}/v1/models", self._models),
                web.post("/s/{session}/v1/chat/completions", self._chat),
                web.post("/s/{session}/v1/completions", self._completions),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def base_url(self, session_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session_id}/v1"

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        given = request.headers.get("Authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return _error(RequestError(None, "a valid 'Authorization: Bearer <api key>' header is required", 401))
        try:
            return await handler(request)
        except RequestError as err:
            return _error(err)

    def _session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["session"])
        if session is None or session.closed:
            raise RequestError(None, f"session '{request.match_info['session']}' is not open", 404)
        return session

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlrun"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        chat = parse_chat(await _json(request))
        turn = session.plan_chat(chat.messages, chat.tools)
        results = await self._generate(session, turn, chat.common)
        choices, keys = [], []
        for i, result in enumerate(results):
            content, calls = self._reply(result, chat)
            session.num_tool_calls += len(calls)
            message = {"role": "assistant", "content": content if (content or not calls) else None}
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": asdict(c)} for c in calls
                ]
            keys.append([*(message_key(m) for m in chat.messages), message_key(message)])
            finish = "tool_calls" if calls else _finish(result)
            logprobs = {"content": self._token_logprobs(result)} if chat.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        session.record(turn, results, keys, None)
        body = _envelope("chat.completion", self.model_name, choices, turn, results)
        if chat.common.stream:
            return await _stream_chat(request, body, chat.common.include_usage)
        return web.json_response(body)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        session = self._session(request)
        completion = parse_completion(await _json(request))
        turn = session.plan_completion(completion.prompt)
        results = await self._generate(session, turn, completion.common)
        choices, texts = [], []
        for i, result in enumerate(results):
            text = self._text(result, completion.common.stop)
            texts.append(completion.prompt + text if isinstance(completion.prompt, str) else None)
            logprobs = None
            if completion.logprobs:
                entries = self._token_logprobs(result)
                logprobs = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries]}
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": _finish(result)})
        session.record(turn, results, None, texts if isinstance(completion.prompt, str) else None)
        body = _envelope("text_completion", self.model_name, choices, turn, results)
        if completion.common.stream:
            return await _stream_events(request, [{**body, "choices": choices}])
        return web.json_response(body)

    async def _generate(self, session: Session, turn: Turn, common) -> list[dict]:
        room = self.max_context_tokens - len(turn.input_ids)
        if room <= 0:
            session.release(turn)
            raise RequestError(
                "messages",
                f"the conversation is {len(turn.input_ids)} tokens, at rollout.max_context_tokens "
                f"({self.max_context_tokens}); end the episode",
            )
        params = {**self.sampling, "n": common.n, "sampling_seed": session.next_seed()}
        params["max_new_tokens"] = min(room, common.max_tokens or params["max_new_tokens"])
        if common.stop:
            params["stop"] = list(common.stop)
        if common.n == 1:  # the embedded engine with session_cache_size keeps the branch's K/V for its next turn
            params["session"] = f"{session.id}/{id(turn.branch):x}"
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(
                self._pool, lambda: self.engine.generate([turn.input_ids], params, return_logprob=True)
            )
        except Exception as err:  # noqa: BLE001 - kept for the rollout to re-raise; the agent gets a 500
            session.release(turn)
            self.engine_error = self.engine_error or err
            raise RequestError(None, f"engine error: {type(err).__name__}: {err}", 500) from err
        if session.closed:  # the agent timed out meanwhile: nothing of this turn trains
            session.release(turn)
            raise RequestError(None, f"session '{session.id}' closed while its request generated", 404)
        session.cached_tokens.append(results[0].get("cached_tokens", 0))
        return results

    def _text(self, result: dict, stop: list[str] | None) -> str:
        """The turn's text without special tokens and without the stop string that ended it (as OpenAI's)."""
        text = self.tokenizer.decode(result["output_ids"], skip_special_tokens=True)
        matched = result["finish_reason"].get("matched")
        if isinstance(matched, str) and text.endswith(matched):
            text = text[: -len(matched)]
        return text

    def _reply(self, result: dict, chat: ChatRequest) -> tuple[str, list]:
        text = self._text(result, chat.common.stop)
        return self.parser.parse(text) if chat.parse_tools else (text, [])

    def _token_logprobs(self, result: dict) -> list[dict]:
        out = []
        for token_id, logprob in zip(result["output_ids"], result["output_logprobs"], strict=True):
            token = self.tokenizer.decode([token_id], skip_special_tokens=False)
            out.append({"token": token, "logprob": float(logprob), "bytes": list(token.encode()), "top_logprobs": []})
        return out


def _finish(result: dict) -> str:
    return "length" if result["finish_reason"]["type"] == "length" else "stop"


def _envelope(kind: str, model: str, choices: list[dict], turn: Turn, results: list[dict]) -> dict:
    completion_tokens = sum(len(r["output_ids"]) for r in results)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(turn.input_ids),
            "prompt_tokens_details": {"cached_tokens": results[0].get("cached_tokens", 0)},
            "completion_tokens": completion_tokens,
            "total_tokens": len(turn.input_ids) + completion_tokens,
        },
    }


async def _stream_chat(request: web.Request, body: dict, include_usage: bool) -> web.StreamResponse:
    """A finished chat completion as OpenAI's chunk sequence: role, content, tool calls, finish, [usage]."""
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for choice in body["choices"]:
        message, i = choice["message"], choice["index"]
        chunks.append({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        if message["content"]:
            delta = {"content": message["content"]}
            chunks.append({"index": i, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None})
        for k, call in enumerate(message.get("tool_calls", [])):
            chunks.append({"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "finish_reason": None})
        chunks.append({"index": i, "delta": {}, "finish_reason": choice["finish_reason"]})
    events = [{**head, "choices": [c]} for c in chunks]
    if include_usage:
        events.append({**head, "choices": [], "usage": body["usage"]})
    return await _stream_events(request, events)


async def _stream_events(request: web.Request, events: list[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _json(request: web.Request):
    try:
        return await request.json()
    except ValueError:
        raise RequestError(None, "the request body must be JSON") from None


def _error(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)
