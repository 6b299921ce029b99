"""Prompt datasets (jsonl -> tokenized Prompt) and the deterministic, resumable PromptSampler."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlrun.config.schema import DataConfig
from rlrun.data.prompts import PromptDataError, PromptDataset, PromptSampler, read_rows
from tiny_models import CHATML_TEMPLATE, make_tokenizer

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is 3 + 4? Reply with only the number."
# SmolLM2-135M-Instruct's template, as shipped: a default system turn when the first message is not one.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Not ChatML, and it inserts a default system turn: rlrun cannot leave it out.
BRACKET_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}[system]default[/system]{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def template_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture
def rows_file(tmp_path):
    return write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": QUESTION, "label": 7, "source": "a"},
            "",
            {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}], "label": "4"},
        ],
    )


def test_chat_prompts_match_the_template(tokenizer, rows_file):
    ds = PromptDataset(DataConfig(path=str(rows_file)), tokenizer)
    assert len(ds) == 2 and [p.index for p in ds.prompts] == [0, 1]
    assert ds[0].prompt_ids == template_ids(tokenizer, [{"role": "user", "content": QUESTION}])
    assert ds[0].label == 7 and ds[0].metadata == {"source": "a"}
    assert ds[1].prompt_ids == template_ids(tokenizer, json.loads(rows_file.read_text().splitlines()[2])["prompt"])
    assert tokenizer.decode(ds[0].prompt_ids) == ds[0].prompt_text


def test_system_prompt_and_raw_text(tokenizer, rows_file):
    ds = PromptDataset(DataConfig(path=str(rows_file), system_prompt="Sys."), tokenizer)
    assert ds[0].prompt_ids == template_ids(
        tokenizer, [{"role": "system", "content": "Sys."}, {"role": "user", "content": QUESTION}]
    )
    assert ds[1].prompt_text.count("system") == 1  # the row's own system turn is kept, not doubled
    single = write_jsonl(rows_file.with_name("raw.jsonl"), [{"prompt": QUESTION, "label": 7}])
    raw = PromptDataset(DataConfig(path=str(single), apply_chat_template=False), tokenizer)
    assert raw[0].prompt_ids == tokenizer(QUESTION)["input_ids"] and raw[0].prompt_text == QUESTION


def test_no_system_prompt_drops_a_default_system_turn(tokenizer, rows_file):
    smol = make_tokenizer()
    smol.chat_template = SMOLLM2_TEMPLATE
    plain = make_tokenizer()  # same vocabulary, ChatML without a default system turn: the expected form
    assert plain.chat_template == CHATML_TEMPLATE
    user = [{"role": "user", "content": QUESTION}]
    ds = PromptDataset(DataConfig(path=str(rows_file)), smol)
    assert ds[0].prompt_ids == template_ids(plain, user) != template_ids(smol, user)
    with_system = PromptDataset(DataConfig(path=str(rows_file), system_prompt="Sys."), smol)
    assert with_system[0].prompt_ids == template_ids(smol, [{"role": "system", "content": "Sys."}] + user)


def test_non_chatml_default_system_turn_is_refused(rows_file):
    bracket = make_tokenizer()
    bracket.chat_template = BRACKET_TEMPLATE
    with pytest.raises(PromptDataError, match=r"data.system_prompt \(None\) must be set"):
        PromptDataset(DataConfig(path=str(rows_file)), bracket)
    ds = PromptDataset(DataConfig(path=str(rows_file), system_prompt="S"), bracket)
    assert ds[0].prompt_text == f"[system]S[/system][user]{QUESTION}[/user][assistant]"


@pytest.mark.slow
def test_real_smollm2_tokenizer_gives_the_24_token_prompt(tmp_path):
    from transformers import AutoTokenizer

    from rlrun.tools.prepare import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    user = [{"role": "user", "content": QUESTION}]
    assert len(template_ids(tok, user)) == 45  # the shipped template's default system turn
    ds = PromptDataset(DataConfig(path=str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": QUESTION, "label": 7}]))), tok)
    assert ds[0].prompt_text == f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert len(ds[0].prompt_ids) == 24 and tok.decode(ds[0].prompt_ids) == ds[0].prompt_text


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", "label": 1', "invalid JSON (Expecting ',' delimiter at column 27)"),
        ('["prompt", "label"]', "a row must be a JSON object, got list"),
        ('{"prompt": "a", "answer": 1}', "missing key 'label' (data.label_key); the row has keys ['answer', 'prompt']"),
        ('{"text": "a", "label": 1}', "missing key 'prompt' (data.prompt_key)"),
        ('{"prompt": 12, "label": 1}', "'prompt' (12) must be a non-empty string or a non-empty list of"),
        ('{"prompt": [{"role": "user"}], "label": 1}', '\'prompt\' ([{"role": "user"}]) must be a non-empty'),
        ('{"prompt": "", "label": 1}', "'prompt' (\"\") must be a non-empty string"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "label": 0}, "", line])
    with pytest.raises(PromptDataError) as info:
        read_rows(path)
    assert str(info.value).startswith(f"{path}:3: {message}")


def test_messages_without_chat_template_and_missing_file(tmp_path, tokenizer):
    path = write_jsonl(
        tmp_path / "m.jsonl", [{"prompt": "x", "label": 0}, {"prompt": [{"role": "user", "content": "x"}], "label": 0}]
    )
    with pytest.raises(PromptDataError, match=re.escape(f"{path}:2: 'prompt' is a list of chat messages")):
        PromptDataset(DataConfig(path=str(path), apply_chat_template=False), tokenizer)
    with pytest.raises(PromptDataError, match="prompt file not found"):
        read_rows(tmp_path / "none.jsonl")


@pytest.fixture(scope="module")
def ten_prompts(tokenizer, tmp_path_factory):
    path = write_jsonl(tmp_path_factory.mktemp("ten") / "p.jsonl", [{"prompt": f"q{i}", "label": i} for i in range(10)])
    return PromptDataset(DataConfig(path=str(path)), tokenizer)


def draw(sampler: PromptSampler, batches: int, n: int) -> list[int]:
    return [p.index for _ in range(batches) for p in sampler.next_batch(n)]


def test_sampler_order_is_seeded_epoch_shuffles(ten_prompts):
    drawn = draw(PromptSampler(ten_prompts, seed=3), batches=10, n=7)  # 70 = 7 epochs, batches straddle epochs
    expected = []
    for epoch in range(7):
        order = list(range(10))
        random.Random(3 + epoch).shuffle(order)
        expected += order
    assert drawn == expected
    assert draw(PromptSampler(ten_prompts, seed=3), 10, 7) == drawn
    assert draw(PromptSampler(ten_prompts, seed=4), 10, 7) != drawn
    assert draw(PromptSampler(ten_prompts, seed=3, shuffle=False), 3, 4) == [i % 10 for i in range(12)]


def test_sampler_resume_neither_drops_nor_repeats(ten_prompts, tokenizer, tmp_path):
    straight = draw(PromptSampler(ten_prompts, seed=0), batches=9, n=3)
    first = PromptSampler(ten_prompts, seed=0)
    before = draw(first, batches=4, n=3)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(ten_prompts, seed=0)
    resumed.load_state_dict(state)
    assert before + draw(resumed, batches=5, n=3) == straight
    two = write_jsonl(tmp_path / "two.jsonl", [{"prompt": "a", "label": 0}, {"prompt": "b", "label": 1}])
    with pytest.raises(ValueError, match=r"num_prompts \(10\) but the dataset has 2 rows"):
        PromptSampler(PromptDataset(DataConfig(path=str(two)), tokenizer), seed=0).load_state_dict(state)


def test_addition_data_is_what_the_generator_writes(tmp_path):
    committed = REPO / "configs" / "data" / "addition_train.jsonl"
    out = tmp_path / "addition.jsonl"
    subprocess.run(
        [sys.executable, str(REPO / "configs" / "data" / "make_addition.py"), str(out)], check=True, capture_output=True
    )
    assert out.read_text() == committed.read_text()
    rows = read_rows(committed)
    pairs = [
        tuple(map(int, re.fullmatch(r"What is (\d) \+ (\d)\? Reply with only the number\.", r.prompt).groups()))
        for r in rows
    ]
    assert sorted(pairs) == [(a, b) for a in range(10) for b in range(10)]
    assert all(r.label == a + b for r, (a, b) in zip(rows, pairs, strict=False))
