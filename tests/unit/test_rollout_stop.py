"""``rollout.stop`` / ``rollout.stop_token_ids`` / ``rollout.skip_special_tokens`` reach the engine (the real
embedded engine, in-process) and end responses where a greedy reference run says they must; a
``generate_fn`` turn's own stop strings replace the run's for that turn only."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from minimal_config import rollout_config
from rlrun.data.sample import Prompt
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.rollout.driver import generate_samples, sampling_params
from rlrun.rollout.multiturn import run_generate_fn

pytestmark = pytest.mark.slow  # loads a model

GREEDY = 1e-7  # the config's temperature must be > 0; below 1e-6 the engine decodes greedily


class Recording:
    def __init__(self, engine):
        self.engine, self.params = engine, []

    def generate(self, input_ids, sampling_params, return_logprob=True):
        self.params.append(sampling_params)
        return self.engine.generate(input_ids, sampling_params, return_logprob=return_logprob)


def test_config_validates_stops():
    with pytest.raises(ValueError, match=r"rollout.stop \(\['a', ''\]\) must hold non-empty strings"):
        rollout_config(stop=["a", ""])
    with pytest.raises(ValueError, match="rollout.stop_token_ids"):
        rollout_config(stop_token_ids=[-1])
    assert "stop" not in sampling_params(rollout_config(), 0)  # unset: the engine sees the params it always saw


def test_stop_strings_and_token_ids_end_responses(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Recording(EmbeddedEngine(model_dir, seed=0))
    prompt = Prompt(index=0, prompt_ids=tokenizer("hello there")["input_ids"], prompt_text="hello there")
    base = {"samples_per_prompt": 1, "max_new_tokens": 12, "temperature": GREEDY, "ignore_eos": False}
    [free] = generate_samples(engine, [prompt], rollout_config(**base), 0, tokenizer)
    assert len(free.response_ids) >= 6, "the greedy reference must run long enough to place a stop in it"
    stop_token = free.response_ids[3]
    first = free.response_ids.index(stop_token)
    [by_id] = generate_samples(engine, [prompt], rollout_config(**base, stop_token_ids=[stop_token]), 0, tokenizer)
    assert by_id.response_ids == free.response_ids[: first + 1] and by_id.finish_reason == "stop"
    assert engine.params[-1]["stop_token_ids"] == [stop_token]

    text = tokenizer.decode(free.response_ids[:5])
    stop = text[-2:] if len(text.strip()) >= 2 else text
    [by_text] = generate_samples(engine, [prompt], rollout_config(**base, stop=[stop]), 0, tokenizer)
    assert engine.params[-1]["stop"] == [stop] and by_text.finish_reason == "stop"
    assert stop in tokenizer.decode(by_text.response_ids)
    assert free.response_ids[: len(by_text.response_ids)] == by_text.response_ids  # a prefix of the free run
    assert stop not in tokenizer.decode(by_text.response_ids[:-1])  # it ended on the token that completed it


def test_skip_special_tokens_controls_the_reward_text(tiny_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    eos = tokenizer.eos_token_id
    prompt = Prompt(index=0, prompt_ids=[1, 2, 3], prompt_text="")
    base = {"samples_per_prompt": 1, "max_new_tokens": 3, "temperature": GREEDY}
    fake = FixedEngine([5, eos])
    [kept] = generate_samples(fake, [prompt], rollout_config(**base, skip_special_tokens=False), 0, tokenizer)
    [skipped] = generate_samples(fake, [prompt], rollout_config(**base), 0, tokenizer)
    assert kept.response_text == tokenizer.decode([5, eos]) != skipped.response_text == tokenizer.decode([5])


class FixedEngine:
    """Answers every prompt with the same tokens (log-probs 0), recording the params it was given."""

    def __init__(self, output_ids):
        self.output_ids, self.params = output_ids, []

    def generate(self, input_ids, sampling_params, return_logprob=True):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        self.params += params
        return [
            {
                "output_ids": list(self.output_ids),
                "output_logprobs": [0.0] * len(self.output_ids),
                "finish_reason": {"type": "stop", "matched": self.output_ids[-1]},
                "weight_version": "0",
            }
            for p in params
            for _ in range(p["n"])
        ]


def test_generate_fn_turns_pass_their_own_stops(tiny_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])
    fake = FixedEngine([7, 8])

    async def agent(traj):
        await traj.generate(stop=["</tool_call>"], stop_token_ids=[9])
        await traj.generate()  # back to the run's stops

    cfg = rollout_config(samples_per_prompt=2, stop=["\n\n"], max_new_tokens=4)
    prompt = Prompt(index=0, prompt_ids=[1, 2], prompt_text="")
    samples = run_generate_fn(agent, fake, [prompt], 2, sampling_params(cfg, 3), 3, tokenizer, 64)
    assert [s.response_ids for s in samples] == [[7, 8, 7, 8]] * 2
    turn_stops = [(p.get("stop"), p.get("stop_token_ids")) for p in fake.params]
    assert turn_stops == [(["</tool_call>"], [9])] * 2 + [(["\n\n"], None)] * 2

    async def bad(traj):
        await traj.generate(stop="</x>")

    with pytest.raises(RuntimeError, match="must be a list of non-empty strings"):
        run_generate_fn(bad, fake, [prompt], 1, sampling_params(cfg, 3), 3, tokenizer, 64)
