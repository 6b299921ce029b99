"""The HTTP reward model client against a real local HTTP server started by the test: request body,
both reply shapes, retries on 5xx, a timeout, no retry on 4xx, and the concurrency bound."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlrun.config.schema import RemoteRewardConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import load_reward_fn, score_samples
from rlrun.rollout.rewards.remote import RemoteReward


class RewardServer(ThreadingHTTPServer):
    """Scores len(response) / 10; the response text scripts failures ("flaky", "slow", "bad", "junk")."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.bodies: list[dict] = []
        self.attempts: dict[str, int] = {}
        self.in_flight = self.peak = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        server: RewardServer = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["response"]
        with server.lock:
            server.bodies.append(body)
            server.attempts[text] = server.attempts.get(text, 0) + 1
            attempt = server.attempts[text]
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
        try:
            code, payload = self.answer(text, attempt)
        finally:  # out of flight before the reply is written: the client sends its next request once it reads it
            with server.lock:
                server.in_flight -= 1
        self.reply(code, payload)

    @staticmethod
    def answer(text: str, attempt: int) -> tuple[int, bytes]:
        time.sleep(0.05)
        if text == "flaky" and attempt < 3:
            return 503, b"busy"
        if text == "slow":
            time.sleep(1.0)
        if text == "bad":
            return 400, b"label missing"
        if text == "junk":
            return 200, b"not json"
        reward = len(text) / 10
        return 200, json.dumps(reward if text.startswith("n") else {"reward": reward}).encode()

    def reply(self, code: int, payload: bytes):
        self.send_response(code)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def server():
    srv = RewardServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def make(texts: list[str]) -> list[Sample]:
    return [
        Sample(
            group_index=i,
            prompt=Prompt(index=i, prompt_ids=[1], prompt_text=f"q{i}", label=i, metadata={"m": i}),
            response_ids=[2],
            response_text=t,
            rollout_logprobs=[0.0],
            finish_reason="stop",
        )
        for i, t in enumerate(texts)
    ]


def test_scores_retries_and_failures(server):
    cfg = RemoteRewardConfig(timeout_s=0.5, max_retries=2, retry_backoff_s=0.01, max_concurrency=4)
    fn = load_reward_fn(server.url, cfg)
    assert isinstance(fn, RemoteReward)
    samples = make(["abcd", "nine char", "flaky", "slow", "bad", "junk", "xy"])
    assert score_samples(samples, fn) == 3
    assert [s.reward for s in samples] == [0.4, 0.9, 0.5, 0.0, 0.0, 0.0, 0.2]
    assert server.attempts["flaky"] == 3  # two 503s, then the answer
    assert server.attempts["slow"] == 3 and samples[3].reward_error.startswith(
        f"RemoteRewardError: {server.url}: no reward after 3 attempts; last error:"
    )
    assert server.attempts["bad"] == 1  # a 4xx is not retried
    assert samples[4].reward_error == f"RemoteRewardError: {server.url}: HTTP 400: label missing"
    assert "must be JSON" in samples[5].reward_error
    first = next(b for b in server.bodies if b["response"] == "abcd")
    assert first == {"prompt": "q0", "response": "abcd", "label": 0, "metadata": {"m": 0}}


def test_waiting_for_a_slot_does_not_count_against_the_timeout(server):
    # one slot: "abcd" waits the whole of "slow"'s attempt, longer than timeout_s, and must still be scored
    fn = load_reward_fn(server.url, RemoteRewardConfig(timeout_s=0.5, max_retries=0, max_concurrency=1))
    samples = make(["slow", "abcd"])
    assert score_samples(samples, fn) == 1
    assert [s.reward for s in samples] == [0.0, 0.4]
    assert samples[1].reward_error is None


def test_concurrency_is_bounded_and_used(server):
    fn = load_reward_fn(server.url, RemoteRewardConfig(max_concurrency=3))
    samples = make([f"r{i}" for i in range(12)])
    assert score_samples(samples, fn) == 0
    assert server.peak == 3  # requests overlapped, never more than max_concurrency
    assert [s.reward for s in samples] == [len(f"r{i}") / 10 for i in range(12)]


def test_unreachable_server_is_a_recorded_failure():
    fn = load_reward_fn("http://127.0.0.1:9/score", RemoteRewardConfig(timeout_s=1, max_retries=1, retry_backoff_s=0))
    samples = make(["a"])
    assert score_samples(samples, fn) == 1
    assert "no reward after 2 attempts" in samples[0].reward_error
