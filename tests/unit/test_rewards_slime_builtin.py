"""slime's ``--rm-type dapo | deepscaler | f1`` as rlrun built-ins, on replies whose scores are worked
out by hand from the rules in each reward's docstring (correct, wrong, malformed, empty)."""

from __future__ import annotations

import pytest

from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import load_reward_fn, score_samples


def sample(reply: str, label) -> Sample:
    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="q", label=label)
    return Sample(0, prompt, [2], reply, [0.0], "stop")


@pytest.mark.parametrize(
    "reply, label, expected",
    [
        ("Let me think. 6 * 7 = 42.\nAnswer: 42", "42", 1.0),
        ("Answer: 41", "42", -1.0),
        ("answer : $42$", 42, 1.0),  # case-insensitive marker, $...$ unwrapped, an int label
        ("Answer: \\boxed{42}", "42", 1.0),
        ("Answer: x = 42", "42", 1.0),  # the text after the last "="
        ("Answer: 42 dollars", "42", 1.0),  # unit words removed
        ("Answer: 1,000", "1000", 1.0),  # thousands commas of a digit string
        ("Answer: 90^\\circ", "90", 1.0),
        ("Answer: 42.0", "42", -1.0),  # the integer is asked for: "42.0" != "42"
        ("Answer: \\frac{84}{2}", "42", -1.0),  # no arithmetic
        ("Answer: -7", "-7", 1.0),
        ("Answer: 7", "-7", -1.0),
        ("Answer: 3\nsome more text\nAnswer: 42", "42", 1.0),  # the last Answer: line counts
        ("Answer: 42\nwait, no.\nAnswer: 43", "42", -1.0),
        ("Answer: 42" + " " * 300, "42", -1.0),  # outside the last 300 characters
        ("the result is 42", "42", -1.0),  # no Answer: line
        ("Answer:", "42", -1.0),  # nothing after the marker
        ("", "42", -1.0),  # empty reply
        ("Answer: 42", "$42$", 1.0),  # the label is normalised too
    ],
)
def test_dapo(reply, label, expected):
    assert load_reward_fn("dapo")(sample(reply, label)) == expected


def test_dapo_refuses_a_non_integer_label():
    s = sample("Answer: 2", "2.5")
    assert score_samples([s], load_reward_fn("dapo")) == 1
    assert s.reward == 0.0
    assert s.reward_error == "ValueError: dapo needs an integer label (DAPO-Math answers are integers), got '2.5'"


@pytest.mark.parametrize(
    "reply, label, expected",
    [
        ("<think>6 * 7</think> so \\boxed{42}", "42", 1.0),
        ("<think>6 * 7</think> so \\boxed{41}", "42", 0.0),
        ("<think>maybe \\boxed{42}</think> no box after", "42", 0.0),  # only the part after </think>
        ("<think>a</think>\\boxed{1}</think>\\boxed{42}", "42", 1.0),  # after the last </think>
        ("<think>a</think>\\boxed{42}</think>\\boxed{1}", "42", 0.0),
        ("\\boxed{42}", "42", 0.0),  # unfinished reasoning: no </think>
        ("###Response \\boxed{42}", "42", 1.0),
        ("###Response \\boxed{42} ###Response \\boxed{1}", "42", 1.0),  # between the first two markers
        ("<think>x</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # answers_equal: exact rationals
        ("<think>x</think>\\boxed{\\frac{1}{2}}", "\\boxed{\\dfrac12}", 1.0),  # a boxed label
        ("<think>x</think>\\boxed{42}", "", 0.0),  # empty label
        ("<think>x</think>\\boxed{}", "\\boxed{}", 0.0),
        ("<think>x</think>\\boxed{42", "42", 0.0),  # cut off inside the box
        ("<think>x</think>", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_deepscaler(reply, label, expected):
    assert load_reward_fn("deepscaler")(sample(reply, label)) == expected


@pytest.mark.parametrize(
    "reply, label, expected",
    [
        ("Paris", "paris.", 1.0),  # case and punctuation ignored
        ("The Eiffel Tower", "eiffel tower", 1.0),  # articles ignored
        # reply {eiffel, tower, in, paris}, label {eiffel, tower}: p = 2/4, r = 2/2, f1 = 2 * 0.5 * 1 / 1.5
        ("the Eiffel Tower in Paris", "Eiffel Tower", 2 / 3),
        # repeated words count as often as both sides have them: common = min(3, 1) = 1; p = 1/3, r = 1
        ("tower tower tower", "tower", 0.5),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),  # empty reply
        ("Paris", "", 0.0),  # empty label
        ("!!!", "...", 0.0),  # both normalise to nothing
        ("yes", "Yes.", 1.0),
        ("yes it is", "yes", 0.0),  # a yes/no label is all or nothing
        ("no", "no answer", 0.0),  # "no" as a whole answer differs from the label
    ],
)
def test_f1(reply, label, expected):
    assert load_reward_fn("f1")(sample(reply, label)) == pytest.approx(expected, abs=1e-12)
