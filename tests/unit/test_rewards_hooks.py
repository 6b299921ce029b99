"""Custom rewards by path: per sample or per group, plain or async; failures score 0, are counted and
logged with their message, and never stop the batch."""

from __future__ import annotations

import logging
import textwrap

import pytest

from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import load_reward_fn, score_samples

HOOKS = textwrap.dedent("""
    import asyncio

    in_flight = 0
    peak = 0

    async def async_len(sample):
        global in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        if sample.response_text == "boom":
            raise RuntimeError("checker crashed on boom")
        return float(len(sample.response_text))

    def rank_in_group(samples):
        # 1.0 for the longest reply of the group, 0.0 for the rest
        longest = max(len(s.response_text) for s in samples)
        if longest == 0:
            raise ValueError("empty group")
        return [float(len(s.response_text) == longest) for s in samples]

    async def async_group_mean_centred(samples):
        await asyncio.sleep(0)
        lengths = [len(s.response_text) for s in samples]
        return [x - sum(lengths) / len(lengths) for x in lengths]

    def wrong_length(samples):
        return [1.0]
""")


def make_samples(replies: list[str], group_size: int) -> list[Sample]:
    out = []
    for i, reply in enumerate(replies):
        prompt = Prompt(index=i // group_size, prompt_ids=[1], prompt_text="q", label=None)
        out.append(
            Sample(
                group_index=prompt.index,
                prompt=prompt,
                response_ids=[2],
                response_text=reply,
                rollout_logprobs=[0.0],
                finish_reason="stop",
            )
        )
    return out


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(HOOKS)
    return lambda name: load_reward_fn(f"{path}:{name}")


def test_async_per_sample_with_bounded_concurrency(hooks, caplog):
    fn = hooks("async_len")
    samples = make_samples(["a", "bb", "boom", "dddd", "", "ffffff", "boom", "h"], group_size=2)
    with caplog.at_level(logging.WARNING, logger="rlrun.rollout.rewards.score"):
        failures = score_samples(samples, fn, concurrency=3)
    assert failures == 2
    assert [s.reward for s in samples] == [1.0, 2.0, 0.0, 4.0, 0.0, 6.0, 0.0, 1.0]
    where = f"(at {fn.__code__.co_filename}:{fn.__code__.co_firstlineno + 7} in async_len)"
    assert samples[2].reward_error == f"RuntimeError: checker crashed on boom {where}"
    assert f"reward failed for 2 sample(s): RuntimeError: checker crashed on boom {where}" in caplog.text
    module = fn.__globals__
    assert module["peak"] == 3  # calls overlapped, and never more than the bound


def test_per_group_plain_and_async(hooks):
    samples = make_samples(["a", "bbb", "cc", "", "", ""], group_size=3)
    assert score_samples(samples, hooks("rank_in_group"), group_size=3) == 3
    assert [s.reward for s in samples] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    [error] = {s.reward_error for s in samples[3:]}  # the whole group failed
    assert error.startswith("ValueError: empty group (at ") and error.endswith(" in rank_in_group)")
    assert score_samples(samples, hooks("async_group_mean_centred"), group_size=3) == 0
    assert [s.reward for s in samples] == [-1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert all(s.reward_error is None for s in samples)  # a rescore clears old errors


def test_group_reward_of_the_wrong_length_fails_the_group(hooks):
    samples = make_samples(["a", "b"], group_size=2)
    assert score_samples(samples, hooks("wrong_length"), group_size=2) == 2
    assert samples[0].reward_error.startswith("TypeError: group reward function returned [1.0]; expected a list of 2")
    with pytest.raises(ValueError, match=r"3 samples do not form whole groups of rollout.samples_per_prompt \(2\)"):
        score_samples(make_samples(["a", "b", "c"], 2), hooks("wrong_length"), group_size=2)
