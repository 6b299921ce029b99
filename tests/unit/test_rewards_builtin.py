"""Built-in correctness and format rewards on tricky answers: fractions, LaTeX, thousands separators,
negative numbers, units, nested braces, cut-off boxes. Expected values are judged by hand."""

from __future__ import annotations

import pytest

from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import load_reward_fn
from rlrun.rollout.rewards.answers import gsm8k_answer, last_boxed


def sample(reply: str, label) -> Sample:
    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="q", label=label)
    return Sample(
        group_index=0,
        prompt=prompt,
        response_ids=[2],
        response_text=reply,
        rollout_logprobs=[0.0],
        finish_reason="stop",
    )


@pytest.mark.parametrize(
    "reply, label, expected",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\tfrac{3}{6}}", "1/2", 1.0),
        (r"\boxed{0.333}", "1/3", 0.0),  # exact rationals: a rounded decimal is wrong
        (r"\boxed{-\frac{3}{4}}", r"\frac{-3}{4}", 1.0),
        (r"\boxed{-0.75}", r"-\frac{3}{4}", 1.0),
        (r"\boxed{\frac{3}{4}}", r"-\frac{3}{4}", 0.0),  # the sign matters
        (r"\boxed{−5}", "-5", 1.0),  # typeset minus sign
        (r"\boxed{1,000,000}", "1000000", 1.0),
        (r"\boxed{12,345.50}", "12345.5", 1.0),
        (r"\boxed{(1,2)}", "(1, 2)", 1.0),  # a tuple is not a thousands separator
        (r"\boxed{(1,2)}", "12", 0.0),
        (r"\boxed{x = 7}", "7", 1.0),
        (r"\boxed{\$42}", "42", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{10\text{ cm}}", "10cm", 1.0),
        (r"\boxed{\left( 3, 4 \right)}", "(3,4)", 1.0),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),  # nested braces, \sqrt3 shorthand
        (r"\boxed{x^{2}+1}", "x^{2}+1", 1.0),
        (r"first \boxed{3} then corrected \boxed{4}", "4", 1.0),  # the last box counts
        (r"first \boxed{3} then corrected \boxed{4}", "3", 0.0),
        (r"\boxed{12", "12", 0.0),  # cut off inside the box
        ("the answer is 12", "12", 0.0),  # math needs a box
        (r"\boxed 5", "5", 1.0),
        (r"\boxed{5}", r"Solution: ... so \boxed{5}.", 1.0),  # a solution as the label: its boxed answer
        (r"\boxed{}", "", 0.0),
    ],
)
def test_math(reply, label, expected):
    assert load_reward_fn("math")(sample(reply, label)) == expected


@pytest.mark.parametrize(
    "reply, label, expected",
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 1234", "Natalia sold 48/2 = 24 clips ... 1,210 + 24 = 1,234\n#### 1,234", 1.0),
        ("#### -7", "-7", 1.0),
        ("#### 7", "-7", 0.0),
        ("#### $18.00", "18", 1.0),
        ("#### 18.", "18", 1.0),
        ("first 5, then #### 6 and 7", "6", 1.0),  # the first number after the marker
        ("no marker: 3 apples and 9 pears", "9", 1.0),  # fallback: the last number
        ("no marker: 3 apples and 9 pears", "3", 0.0),
        ("no numbers at all", "3", 0.0),
        ("#### 0.5", "1/2", 1.0),
    ],
)
def test_gsm8k(reply, label, expected):
    assert load_reward_fn("gsm8k")(sample(reply, label)) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        (r"thinking... \boxed{3}", 1.0),
        (r"\boxed{3} or \boxed{4}", 0.0),
        (r"\boxed{ }", 0.0),
        (r"\boxed{3", 0.0),
        ("3", 0.0),
    ],
)
def test_format_boxed(reply, expected):
    assert load_reward_fn("format_boxed")(sample(reply, None)) == expected


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("<think>3 + 4 is 7</think>The answer is 7.", 1.0),
        ("  <think>a</think>\n7", 1.0),
        ("<think></think>7", 0.0),  # no reasoning
        ("<think>a</think>", 0.0),  # no answer
        ("7 <think>a</think> 7", 0.0),  # something before the block
        ("<think>a</think>7<think>b</think>8", 0.0),  # two blocks
        ("<think>a 7", 0.0),  # never closed
    ],
)
def test_format_think(reply, expected):
    assert load_reward_fn("format_think")(sample(reply, None)) == expected


def test_extractors():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \fbox{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None
    assert gsm8k_answer("x #### 1,234.5 units") == "1,234.5"
    assert gsm8k_answer("-3 and then -4") == "-4"
