"""Turns appended after a model turn go through the tokenizer's chat template: the tokens of prompt + sampled
turn + appended messages equal the template's rendering of the whole conversation, tokenized (SmolLM2's template,
which injects a default system turn, and the tests' tiny ChatML tokenizer)."""

from __future__ import annotations

import pytest

from rlrun.agents.template import ChatTemplate, TemplateError
from rlrun.data.sample import Prompt
from rlrun.rollout.multiturn import Trajectory


@pytest.fixture(scope="module", params=["tiny-chatml", "smollm2"])
def tokenizer(request):
    """SmolLM2's comes through conftest's ``smollm2`` fixture, which prepares it on a fresh clone."""
    from transformers import AutoTokenizer

    from tests.tiny_models import make_tokenizer

    if request.param == "smollm2":
        return AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2"))
    return make_tokenizer()


def trajectory(tokenizer, messages) -> Trajectory:
    template = ChatTemplate(tokenizer)
    ids = template.prompt_ids(messages)
    prompt = Prompt(index=0, prompt_ids=ids, prompt_text=template.render(messages))
    return Trajectory(prompt, 0, tokenizer, {}, batcher=None, seed=0, max_context_tokens=4096)


def model_turn(traj: Trajectory, text: str, end: bool) -> None:
    """What traj.generate() appends: the turn's tokens, with the end-of-turn token when the model stopped."""
    ids = traj.tokenizer(text, add_special_tokens=False)["input_ids"] + ([traj.tokenizer.eos_token_id] if end else [])
    traj.response_ids += ids
    traj.loss_mask += [1] * len(ids)
    traj.logprobs += [-0.5] * len(ids)
    traj.after_model_turn = True


@pytest.mark.parametrize("ended", [True, False], ids=["model-ended-turn", "cut-at-length"])
def test_appended_turns_equal_the_templates_rendering(tokenizer, ended):
    chat = [{"role": "user", "content": "What is 6 * 7?"}]
    traj = trajectory(tokenizer, chat)
    model_turn(traj, "<calc>6*7</calc>", end=ended)
    appended = traj.append_message("tool", "42")
    model_turn(traj, "42", end=True)
    whole = [*chat, {"role": "assistant", "content": "<calc>6*7</calc>"}, {"role": "tool", "content": "42"}]
    reference = ChatTemplate(tokenizer).encode(ChatTemplate(tokenizer).render(whole) + "42" + tokenizer.eos_token)
    assert traj.prompt.prompt_ids + traj.response_ids == reference
    n = len(appended)
    first = len(traj.response_ids) - n - 3  # the tool turn sits between the two model turns ("42" + eos)
    assert traj.loss_mask[first : first + n] == [0] * n and traj.logprobs[first : first + n] == [0.0] * n
    text = tokenizer.decode(appended, skip_special_tokens=False)
    assert text == ("" if ended else "<|im_end|>") + "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_messages_must_follow_a_model_turn():
    from tests.tiny_models import make_tokenizer

    traj = trajectory(make_tokenizer(), [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="must follow traj.generate"):
        traj.append_message("tool", "1")
    model_turn(traj, "x", end=True)
    traj.append_messages([{"role": "tool", "content": "1"}, {"role": "user", "content": "go on"}])
    with pytest.raises(ValueError, match="must follow traj.generate"):
        traj.append_message("user", "again")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    from tests.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    # Shows only the last assistant turn's content: appending a turn changes the text already sampled.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}"
    )
    with pytest.raises(TemplateError, match="renders the conversation differently"):
        ChatTemplate(tokenizer).after_model_turn([{"role": "tool", "content": "1"}], None)
