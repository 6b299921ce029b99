"""Reward functions: built-in formulas, hooks loaded by path, and failure counting in score_samples."""

from __future__ import annotations

import textwrap

import pytest

from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import RewardSpecError, exact_match, first_number, load_reward_fn, score_samples


def sample(reply: str, label, finish_reason: str = "stop", group: int = 0) -> Sample:
    prompt = Prompt(index=group, prompt_ids=[1, 2], prompt_text="q", label=label)
    return Sample(
        group_index=group,
        prompt=prompt,
        response_ids=[3],
        response_text=reply,
        rollout_logprobs=[-0.1],
        finish_reason=finish_reason,
    )


def brevity(reply: str, answer: str) -> float:
    """quickstart-task.md: 0.5 + 0.5 * max(0, 1 - (len(reply.strip()) - len(answer)) / 20)."""
    return 0.5 + 0.5 * max(0.0, 1.0 - (len(reply.strip()) - len(answer)) / 20)


@pytest.mark.parametrize(
    "reply, label, finish, expected",
    [
        ("7", 7, "stop", 1.0),
        ("7", "7", "stop", 1.0),
        ("  7\n", 7, "stop", 1.0),
        ("It's 7.", 7, "stop", brevity("It's 7.", "7")),
        ("The answer is 17, of course.", 17, "stop", brevity("The answer is 17, of course.", "17")),
        ("7 is the sum of the two numbers given in the question above", 7, "stop", 0.5),  # bonus floors at 0
        ("The answer is 7", 7, "length", 0.5),  # cut off: no brevity bonus
        ("7", 7, "abort", 0.5),
        ("3 + 4 = 7", 7, "stop", 0.0),  # the first integer decides
        ("8", 7, "stop", 0.0),
        ("seventy", 70, "stop", 0.0),
        ("", 0, "stop", 0.0),
        ("-3", -3, "stop", 1.0),
        ("10", 1, "stop", 0.0),
    ],
)
def test_first_number_matches_the_formula(reply, label, finish, expected):
    assert first_number(sample(reply, label, finish)) == pytest.approx(expected)


@pytest.mark.parametrize(
    "reply, label, expected", [("7", 7, 1.0), (" 7 \n", "7", 1.0), ("It's 7", 7, 0.0), ("", "", 1.0)]
)
def test_exact_match(reply, label, expected):
    assert exact_match(sample(reply, label)) == expected


def test_score_samples_counts_and_records_failures(tmp_path):
    hook = tmp_path / "my_reward.py"
    hook.write_text(
        textwrap.dedent("""
        def score(sample):
            if "boom" in sample.response_text:
                raise KeyError("no answer for " + sample.response_text)
            if sample.response_text == "text":
                return "1.0"
            return float(len(sample.response_text))
    """)
    )
    fn = load_reward_fn(f"{hook}:score")
    samples = [sample("ab", 0), sample("boom!", 0, group=1), sample("text", 0, group=2), sample("abcd", 0)]
    samples[1].reward = 5.0  # a stale value must not survive a failure
    assert score_samples(samples, fn) == 2
    assert [s.reward for s in samples] == [2.0, 0.0, 0.0, 4.0]
    # the user's line that raised: the message alone does not say which line to fix
    assert samples[1].reward_error == f"KeyError: 'no answer for boom!' (at {hook}:4 in score)"
    assert samples[2].reward_error.startswith("TypeError: reward function returned '1.0'")
    assert samples[0].reward_error is None and samples[3].reward_error is None


def test_first_number_with_a_non_integer_label_is_a_recorded_failure():
    s = sample("7", "seven")
    assert score_samples([s], first_number) == 1
    assert s.reward == 0.0 and s.reward_error == "ValueError: first_number needs an integer label, got 'seven'"


def test_builtins_and_module_specs(tmp_path, monkeypatch):
    assert load_reward_fn("first_number") is first_number
    assert load_reward_fn("exact_match") is exact_match
    (tmp_path / "rlrun_test_rewards_mod.py").write_text("def length(sample, scale=1.0):\n    return scale\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_fn("rlrun_test_rewards_mod:length")(sample("x", 0)) == 1.0


@pytest.mark.parametrize(
    "spec, reason",
    [
        (
            "firstnumber",
            "not a built-in (first_number, exact_match, math, gsm8k, format_boxed, format_think, dapo, deepscaler, "
            "f1, math_verify), "
            "not an http(s):// URL and not of the form module:function",
        ),
        ("no_such_module_xyz:f", "module 'no_such_module_xyz' not found on sys.path"),
        ("json:nope", "'json' has no attribute 'nope'"),
        ("json:decoder", "'json:decoder' is of type module, not a function"),
        ("{tmp}/missing.py:f", "file '{tmp}/missing.py' not found"),
        ("{tmp}/two_args.py:score", "it takes (response, label)"),
        ("{tmp}/broken.py:score", "importing '{tmp}/broken.py' raised ZeroDivisionError: division by zero"),
    ],
)
def test_bad_specs_name_the_spec_and_the_signature(tmp_path, spec, reason):
    (tmp_path / "two_args.py").write_text("def score(response, label):\n    return 0.0\n")
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    spec, reason = spec.format(tmp=tmp_path), reason.format(tmp=tmp_path)
    with pytest.raises(RewardSpecError) as info:
        load_reward_fn(spec)
    message = str(info.value)
    assert message.startswith(f"reward '{spec}': {reason}")
    assert (
        message.endswith(
            "with signature fn(sample: Sample) -> float (or async; per group: fn(samples: list[Sample]) -> "
            "list[float]; verl's compute_score(data_source, solution_str, ground_truth, extra_info=None); TRL's "
            "fn(prompts, completions, **kwargs) -> list[float])"
        )
        and "\n" not in message
    )
