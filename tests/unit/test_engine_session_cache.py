"""The embedded engine's session cache (``session_cache_size``): a session's K/V kept across calls, so a turn that
extends the session's tokens prefills only its new ones. Checked against the same engine without the cache, which
prefills every turn from its first token."""

from __future__ import annotations

import pytest
import torch

from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.embedded.session_cache import KeptSession, SessionCache, reusable_columns

pytestmark = pytest.mark.slow  # loads models

SYSTEM = [5, 17, 29, 31, 8, 44, 61, 70, 12, 90, 3, 7]
USER = [[101, 102, 103], [111, 112], [121, 122, 123, 124], [131, 132]]
"""The new tokens of each of four turns (a tool result, a user message: any tokens that are not the model's)."""


def _conversation(engine: EmbeddedEngine, session: str | None, turns: int = 4) -> tuple[list[dict], list[int]]:
    """``turns`` calls of one conversation: each prompt is the last prompt, its response and the next turn's tokens;
    returns the results and the prefill tokens each call forwarded."""
    prompt, results, prefilled = list(SYSTEM), [], []
    for t in range(turns):
        prompt = prompt + USER[t]
        before = engine.sessions.prefill_tokens
        params = {"max_new_tokens": 7, "temperature": 1.0, "sampling_seed": 40 + t, "ignore_eos": True}
        (result,) = engine.generate([prompt], {**params, "session": session})
        prefilled.append(engine.sessions.prefill_tokens - before)
        results.append(result)
        prompt = prompt + result["output_ids"]
    return results, prefilled


def test_four_turns_with_the_cache_sample_as_without_and_prefill_only_the_new_tokens(tiny_model_dirs):
    plain = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    cached = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, session_cache_size=4)
    want, full = _conversation(plain, "s")  # no session_cache_size: the session is ignored
    got, suffix = _conversation(cached, "s")
    lengths = [len(SYSTEM) + sum(len(u) for u in USER[: t + 1]) + 7 * t for t in range(4)]
    assert full == lengths and "cached_tokens" not in want[0]
    # Turn t + 1 forwards the last output token of turn t (sampled, never forwarded) and its own new tokens.
    assert suffix == [lengths[0]] + [1 + len(USER[t]) for t in range(1, 4)]
    assert [r["cached_tokens"] for r in got] == [0] + [lengths[t] - 1 - len(USER[t]) for t in range(1, 4)]
    assert cached.sessions.reused_tokens == sum(r["cached_tokens"] for r in got)
    gaps = []
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"]
        gaps.append((torch.tensor(a["output_logprobs"]) - torch.tensor(b["output_logprobs"])).abs().max().item())
    # SDPA on CPU rounds its sums by the query length, so a suffix prefill is not bitwise a whole one.
    print("session cache: largest log-prob difference per turn", gaps)
    assert gaps[0] == 0.0 and max(gaps) < 1e-5, gaps


def test_a_prompt_that_does_not_extend_the_session_drops_it(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, session_cache_size=4)
    params = {"max_new_tokens": 4, "sampling_seed": 1, "ignore_eos": True, "session": "a"}
    (first,) = engine.generate([SYSTEM], params)
    assert len(engine.sessions) == 1
    edited = [SYSTEM[0] + 1, *SYSTEM[1:], *first["output_ids"], 9, 9]  # history rewritten
    (second,) = engine.generate([edited], params)
    assert second["cached_tokens"] == 0
    extended = edited + second["output_ids"] + [4, 4]
    (third,) = engine.generate([extended], params)
    assert third["cached_tokens"] == len(edited) + len(second["output_ids"]) - 1
    name, weight = next(iter(engine.named_parameters().items()))
    engine.load_weights([(name, weight.clone())])  # a weight update drops every session
    assert len(engine.sessions) == 0
    (fourth,) = engine.generate([extended + third["output_ids"] + [2, 2]], params)
    assert fourth["cached_tokens"] == 0


def test_sessions_and_plain_prompts_in_one_call_sample_as_apart(tiny_model_dirs):
    """A merged call of a session's second turn, a new session and a two-sample prompt: the session turn prefills
    apart from the others (which share no kept columns), and every row samples as in its own call."""
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, session_cache_size=2)
    base = {"max_new_tokens": 5, "ignore_eos": True}
    (first,) = engine.generate([SYSTEM], {**base, "sampling_seed": 3, "session": "x"})
    prompts = [SYSTEM + first["output_ids"] + [7, 8], [50, 51, 52], [60, 61, 62, 63]]
    params = [
        {**base, "sampling_seed": 4, "session": "x"},
        {**base, "sampling_seed": 5, "session": "y"},
        {**base, "sampling_seed": 6, "n": 2},
    ]
    merged = engine.generate(prompts, params)
    assert [r.get("cached_tokens") for r in merged] == [len(SYSTEM) + 4, 0, None, None]
    apart = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    for k, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        rows = apart.generate([prompt], p)
        for a, b in zip([r for r in merged if r["prompt_tokens"] == len(prompt)], rows, strict=True):
            assert a["output_ids"] == b["output_ids"], k
            torch.testing.assert_close(
                torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]), rtol=0, atol=1e-5
            )


def test_the_cache_keeps_at_most_its_size_least_recently_used_out():
    cache = SessionCache(2)
    kv = [torch.zeros(1, 3, 2)]
    for name in ("a", "b"):
        cache.keep(name, [1, 2, 3], kv, kv)
    assert cache.prefix("a", [1, 2, 3, 4]) is not None  # "a" used last: "b" goes first
    cache.keep("c", [1, 2, 3], kv, kv)
    assert cache.prefix("b", [1, 2, 3, 4]) is None and cache.prefix("a", [1, 2, 3, 4]) is not None
    assert len(cache) == 2
    with pytest.raises(ValueError, match=r"session_cache_size \(-1\) must be an integer >= 0"):
        SessionCache(-1)


def test_reusable_columns_leave_every_prompts_last_token_and_two_columns_to_forward():
    kept = KeptSession([1, 2, 3, 4], [], [])
    assert reusable_columns([[1, 2, 3, 4, 5, 6]], [kept]) == 4
    assert reusable_columns([[1, 2, 3, 4, 5]], [kept]) == 3  # one new token: two columns still forward
    assert reusable_columns([[1, 2, 3, 4]], [kept]) == 2
    assert reusable_columns([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9, 9]], [kept, KeptSession([1, 2], [], [])]) == 2
    assert reusable_columns([[1, 2, 3, 4, 5, 6], [7, 8, 9]], [kept, None]) == 0
