"""The embedded engine in-process, against Hugging Face transformers as the independent reference."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlrun.engine.backends.embedded import EmbeddedEngine
from rlrun.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # loads models

PROMPTS = [[72, 101, 108, 108, 111], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9]]  # different lengths: left padding


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from one unpadded forward over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_logprobs_match_an_hf_forward_before_filtering(tiny_model_dirs, kind):
    engine = EmbeddedEngine(tiny_model_dirs[kind], seed=0)
    params = {"max_new_tokens": 10, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "n": 2, "ignore_eos": True}
    results = engine.generate(PROMPTS, params)
    reference = hf_model(tiny_model_dirs[kind])
    assert len(results) == len(PROMPTS) * 2
    for k, result in enumerate(results):
        prompt = PROMPTS[k // 2]  # prompt-major
        assert result["prompt_tokens"] == len(prompt) and result["completion_tokens"] == 10
        assert result["finish_reason"] == {"type": "length", "length": 10}
        want = hf_logprobs(reference, prompt, result["output_ids"], temperature=0.7)
        torch.testing.assert_close(torch.tensor(result["output_logprobs"]), want, rtol=0, atol=1e-5)


def test_top_k_1_matches_hf_greedy_decoding(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], seed=0)
    results = engine.generate(PROMPTS, {"max_new_tokens": 12, "top_k": 1, "ignore_eos": True})
    reference = hf_model(tiny_model_dirs["qwen2"])
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 12) for p in PROMPTS]


def test_eos_from_generation_config_and_stop_tokens_end_a_response(tiny_model_dirs, tmp_path):
    greedy = hf_greedy(hf_model(tiny_model_dirs["qwen2"]), PROMPTS[0], 12)
    stop = greedy[3]
    cut = greedy.index(stop) + 1  # the stop token is kept, as SGLang does
    expected = {"output_ids": greedy[:cut], "finish_reason": {"type": "stop", "matched": stop}}
    params = {"max_new_tokens": 12, "top_k": 1}

    by_param = EmbeddedEngine(tiny_model_dirs["qwen2"]).generate(PROMPTS[:1], dict(params, stop_token_ids=[stop]))[0]
    assert {k: by_param[k] for k in expected} == expected

    model_dir = shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "eos_model")
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], stop]
    config_path.write_text(json.dumps(config))
    engine = EmbeddedEngine(model_dir)
    assert stop in engine.eos_token_ids
    by_eos = engine.generate(PROMPTS[:1], params)[0]
    assert {k: by_eos[k] for k in expected} == expected
    ignored = engine.generate(PROMPTS[:1], dict(params, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert ignored["output_ids"] == greedy and ignored["finish_reason"] == {"type": "length", "length": 12}


def test_seeded_samples_are_reproducible_distinct_and_batch_independent(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    params = {"max_new_tokens": 8, "temperature": 1.0, "n": 4, "sampling_seed": 1234, "ignore_eos": True}
    alone = [r["output_ids"] for r in engine.generate(PROMPTS[:1], params)]
    again = [r["output_ids"] for r in engine.generate(PROMPTS[:1], params)]
    batched = [r["output_ids"] for r in engine.generate(PROMPTS, params)][:4]
    other_seed = [r["output_ids"] for r in engine.generate(PROMPTS[:1], dict(params, sampling_seed=99))]
    assert alone == again == batched
    assert len({tuple(ids) for ids in alone}) > 1  # the n samples of a group are not copies
    assert other_seed != alone
    seeds = SamplingParams(sampling_seed=1234)
    assert seeds.sample_seed(PROMPTS[0], 0) != seeds.sample_seed(PROMPTS[1], 0)  # prompts do not share draws


def test_load_weights_checks_every_name_and_shape_before_copying(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["llama"])  # tied embeddings
    embed = engine.model.get_input_embeddings().weight
    before = embed.clone()
    good = ("model.embed_tokens.weight", torch.zeros_like(embed))
    with pytest.raises(ValueError, match="lm_head.weight must not be sent because it is tied to model.embed_tokens"):
        engine.load_weights([good, ("lm_head.weight", torch.zeros_like(embed))])
    with pytest.raises(ValueError, match="weight model.nope.weight must be a parameter of LlamaForCausalLM"):
        engine.load_weights([good, ("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"shape of weight model.norm.weight \(\[3\]\) must equal the model's \[64\]"):
        engine.load_weights([good, ("model.norm.weight", torch.zeros(3))])
    assert torch.equal(embed, before)  # nothing copied from the rejected buckets
    engine.load_weights([good])
    assert torch.count_nonzero(engine.model.get_output_embeddings().weight) == 0  # lm_head follows embed_tokens


def test_invalid_sampling_params_are_rejected_with_the_key(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match=r"sampling_params.temperature \(0\) must be > 0"):
        engine.generate(PROMPTS, {"temperature": 0})
    with pytest.raises(ValueError, match=r"keys \['stop'\] must be among"):
        engine.generate(PROMPTS, {"stop": ["\n"]})
    with pytest.raises(ValueError, match=r"input_ids\[0\] must be a non-empty list"):
        engine.generate([[]], {})
