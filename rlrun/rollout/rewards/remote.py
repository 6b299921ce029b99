"""A reward model served over HTTP: ``rollout.reward: http://host:port/path``.

Each sample is one ``POST`` of JSON ``{"prompt", "response", "label", "metadata"}`` (prompt and
response as text); the server answers with a JSON number or ``{"reward": number}``. Calls are async
(awaited together by :func:`rlrun.rollout.rewards.score.score_samples`), each attempt is bounded by
``timeout_s`` (counted from when its request starts, not while it waits for a free slot), connection
errors / timeouts / HTTP 429 and 5xx are retried with exponential backoff, other HTTP errors fail at
once, and at most ``max_concurrency`` requests are in flight (a bounded thread pool runs the stdlib HTTP
client, so no extra dependency is needed). ``headers`` (e.g. an API key) are sent with every request,
environment variables expanded when the reward is loaded. A sample whose request finally fails raises here,
which scores it 0 and records the message like any failing reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from rlrun.config.schema import RemoteRewardConfig
from rlrun.data.sample import Sample

_BODY_CHARS = 200


class RemoteRewardError(RuntimeError):
    """The reward server refused a request or never answered within the retries."""


class _Retryable(Exception):
    """A failure worth another attempt (the server may be busy or restarting)."""


class RemoteReward:
    """Async per-sample reward function backed by an HTTP reward server (see the module docstring)."""

    def __init__(self, url: str, cfg: RemoteRewardConfig = RemoteRewardConfig()):
        self.url = url
        self.cfg = cfg
        self._headers = {"Content-Type": "application/json", **expand_headers(cfg.headers)}  # secrets: never logged
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_concurrency, thread_name_prefix="rlrun-reward")
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"

    async def __call__(self, sample: Sample) -> float:
        body = json.dumps(request_body(sample), default=str).encode()
        attempts = self.cfg.max_retries + 1
        for attempt in range(attempts):
            try:
                return parse_reply(await self._attempt(body))
            except _Retryable as err:
                last = str(err)
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.cfg.retry_backoff_s * 2**attempt)
        raise RemoteRewardError(f"{self.url}: no reward after {attempts} attempts; last error: {last}")

    async def _attempt(self, body: bytes) -> bytes:
        """One POST in a pool thread, timed from its start. A slot is held until the thread is done, even
        after a timeout, so the pool never queues: time spent waiting behind a slow request never counts
        against another request's ``timeout_s``."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # score_samples runs one event loop per batch
            self._slots = (loop, asyncio.Semaphore(self.cfg.max_concurrency))
        async with self._slots[1]:
            future = loop.run_in_executor(self._pool, self._post, body)
            done, _ = await asyncio.wait({future}, timeout=self.cfg.timeout_s)
            if not done:
                with contextlib.suppress(Exception):  # the thread ends at its own socket timeout
                    await future
                raise _Retryable(f"no reply within timeout_s ({self.cfg.timeout_s})")
            return future.result()

    def _post(self, body: bytes) -> bytes:
        request = urllib.request.Request(self.url, data=body, headers=self._headers)
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as err:
            text = err.read()[:_BODY_CHARS].decode(errors="replace")
            if err.code == 429 or err.code >= 500:
                raise _Retryable(f"HTTP {err.code}: {text}") from None
            raise RemoteRewardError(f"{self.url}: HTTP {err.code}: {text}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            raise _Retryable(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from None


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def expand_headers(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with ``$VAR`` / ``${VAR}`` replaced from the environment; an unset variable raises naming
    the header and the variable (not the value)."""

    def value(name: str, text: str) -> str:
        def variable(match: re.Match) -> str:
            var = match[1] or match[2]
            if var not in os.environ:
                raise ValueError(
                    f"rollout.remote_reward.headers.{name} names the environment variable {var}, which is not set; "
                    f"export {var} before starting rlrun"
                )
            return os.environ[var]

        return _VARIABLE.sub(variable, text)

    return {name: value(name, text) for name, text in headers.items()}


def request_body(sample: Sample) -> dict:
    prompt = sample.prompt
    return {
        "prompt": prompt.prompt_text,
        "response": sample.response_text,
        "label": prompt.label,
        "metadata": prompt.metadata,
    }


def parse_reply(raw: bytes) -> float:
    """The reward in a server reply: a JSON number, or an object with a numeric ``reward``."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        raise RemoteRewardError(
            f'reply ({raw[:_BODY_CHARS]!r}) must be JSON: a number or {{"reward": number}}'
        ) from None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RemoteRewardError(f'reply ({raw[:_BODY_CHARS]!r}) must be a number or {{"reward": number}}')
    return float(value)
