"""Rewards as verl and TRL write them, used with no adapter: the signature is told from the parameters, and
each is called with what its framework passes (verl: data_source, solution_str, ground_truth, extra_info; TRL:
prompts, completions and the row's columns as keyword lists). Plus the math_verify built-in's verdicts on the
pairs of benchmarks/math_verify_table.py, and remote reward headers expanded from the environment."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from rlrun.config.schema import RemoteRewardConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import RewardSpecError, load_reward_fn, score_samples
from rlrun.rollout.rewards.remote import RemoteReward

REPO = Path(__file__).resolve().parents[2]
HOOKS = textwrap.dedent("""
    calls = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth, extra_info))
        return float(solution_str.strip() == ground_truth)

    def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "acc": 0.5}

    def accuracy_reward(completions, solution, **kwargs):
        calls.append((completions, solution, sorted(kwargs)))
        return [float(c.strip() == s) for c, s in zip(completions, solution)]

    def trl_no_kwargs(prompts, completions):
        return [float(len(p) > 0) + len(c) for p, c in zip(prompts, completions)]
""")


def make_samples(replies, label, metadata):
    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="What is 3 + 4?", label=label, metadata=metadata)
    return [Sample(0, prompt, [2, 3], reply, [0.0, 0.0], "stop") for reply in replies]


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(HOOKS)
    return lambda name: load_reward_fn(f"{path}:{name}")


def test_verl_compute_score_gets_verl_arguments(hooks):
    fn = hooks("compute_score")
    metadata = {"data_source": "addition", "extra_info": {"index": 34}, "ability": "math"}
    samples = make_samples(["7", " 8"], "7", metadata)
    assert score_samples(samples, fn) == 0
    assert [s.reward for s in samples] == [1.0, 0.0]
    calls = fn.fn.__globals__["calls"]
    assert calls == [("addition", "7", "7", {"index": 34}), ("addition", " 8", "7", {"index": 34})]
    dict_samples = make_samples(["7"], "7", metadata)
    assert score_samples(dict_samples, hooks("verl_dict"), reward_key="score") == 0
    assert dict_samples[0].reward == 1.0 and dict_samples[0].reward_components == {"score": 1.0, "acc": 0.5}


def test_trl_batch_reward_per_sample_and_per_group(hooks):
    fn = hooks("accuracy_reward")
    samples = make_samples(["7", "9", " 7 ", "x"], None, {"solution": "7", "level": 2})
    assert score_samples(samples, fn) == 0  # per sample: batches of one
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert score_samples(samples, fn, group_size=4) == 0  # per group: one call with the group
    calls = fn.fn.__globals__["calls"]
    assert calls[-1] == (["7", "9", " 7 ", "x"], ["7"] * 4, ["completion_ids", "label", "level", "prompts"])
    plain = make_samples(["ab"], "7", {})
    assert score_samples(plain, hooks("trl_no_kwargs")) == 0 and plain[0].reward == 3.0  # only what it names


def test_an_rlrun_reward_must_take_one_argument(tmp_path):
    (tmp_path / "two.py").write_text("def score(response, label):\n    return 0.0\n")
    with pytest.raises(RewardSpecError, match=r"it takes \(response, label\)"):
        load_reward_fn(f"{tmp_path / 'two.py'}:score")


sys.path.insert(0, str(REPO / "benchmarks"))
from math_verify_table import PAIRS, verdicts  # noqa: E402

MATH_VERIFY_WRONG = {("1000", "1e3")}
"""The one pair math-verify gets wrong: it reads ``1e3`` as ``1 * e * 3``."""


@pytest.mark.parametrize("label, answer, equal", PAIRS)
def test_math_verify_verdicts(label, answer, equal):
    pytest.importorskip("math_verify")
    expected = equal if (label, answer) not in MATH_VERIFY_WRONG else not equal
    assert verdicts(label, answer)["math_verify"] is expected


def test_remote_headers_expand_the_environment_and_stay_out_of_repr(monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "s3cret")
    cfg = RemoteRewardConfig(headers={"Authorization": "Bearer ${REWARD_TOKEN}", "X-Team": "rl"})
    reward = RemoteReward("http://127.0.0.1:9/score", cfg)
    assert reward._headers["Authorization"] == "Bearer s3cret" and reward._headers["X-Team"] == "rl"
    assert "s3cret" not in repr(reward)
    monkeypatch.delenv("REWARD_TOKEN")
    with pytest.raises(RewardSpecError) as info:
        load_reward_fn("http://127.0.0.1:9/score", cfg)
    assert "rollout.remote_reward.headers.Authorization names the environment variable REWARD_TOKEN" in str(info.value)
