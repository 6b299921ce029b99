"""The embedded engine in-process, against Hugging Face transformers as the independent reference."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_contract import hf_greedy, hf_logprobs
from rlrun.engine.embedded.decode_control import DecodeControl
from rlrun.engine.embedded.engine import SYNC_EVERY, EmbeddedEngine
from rlrun.engine.sampling import SamplingParams, filter_probs, row_rids
from tiny_models import FAMILY_KINDS

pytestmark = pytest.mark.slow  # loads models

PROMPTS = [[72, 101, 108, 108, 111], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9]]  # different lengths: padding


def hf_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_logprobs_match_an_hf_forward_renormalised_over_the_kept_set(tiny_model_dirs, kind):
    """Top-p / top-k rows report the sampling distribution's log-prob (renormalised over the kept set, top-p
    mask replay) and that kept set, which is the filter's survivors under an HF forward's probabilities."""
    from rlrun.engine.kept_set import decode_kept_ids

    engine = EmbeddedEngine(tiny_model_dirs[kind], seed=0)
    params = {"max_new_tokens": 10, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "n": 2, "ignore_eos": True}
    results = engine.generate(PROMPTS, params)
    reference = hf_model(tiny_model_dirs[kind])
    assert len(results) == len(PROMPTS) * 2
    for k, result in enumerate(results):
        prompt = PROMPTS[k // 2]  # prompt-major
        assert result["prompt_tokens"] == len(prompt) and result["completion_tokens"] == 10
        assert result["finish_reason"] == {"type": "length", "length": 10}
        kept = decode_kept_ids(result["kept_ids"], 10)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + result["output_ids"]])).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / 0.7, dim=-1)
        survivors = filter_probs(logp.exp(), [SamplingParams(temperature=0.7, top_k=20, top_p=0.9)] * 10)
        for j, token in enumerate(result["output_ids"]):
            ids = kept[j][kept[j] >= 0].long()
            assert set(ids.tolist()) == set(survivors[j].nonzero().flatten().tolist()) and token in ids.tolist()
            want = logp[j, token] - torch.logsumexp(logp[j, ids], dim=0)
            torch.testing.assert_close(torch.tensor(result["output_logprobs"][j]), want, rtol=0, atol=1e-5)


def test_logprobs_without_a_filter_match_an_hf_forward(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    results = engine.generate(PROMPTS, {"max_new_tokens": 6, "temperature": 0.7, "n": 2, "ignore_eos": True})
    reference = hf_model(tiny_model_dirs["qwen3"])
    for k, result in enumerate(results):
        assert "kept_ids" not in result
        want = hf_logprobs(reference, PROMPTS[k // 2], result["output_ids"], temperature=0.7)
        torch.testing.assert_close(torch.tensor(result["output_logprobs"]), want, rtol=0, atol=1e-5)


def test_top_k_1_matches_hf_greedy_decoding(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], seed=0)
    results = engine.generate(PROMPTS, {"max_new_tokens": 12, "top_k": 1, "ignore_eos": True})
    reference = hf_model(tiny_model_dirs["qwen2"])
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("kind", list(FAMILY_KINDS))
def test_scaled_rope_and_mistral_models_generate_as_hf(family_model_dirs, kind):
    """The engine serves the RoPE-scaling and Mistral kinds (transformers computes them): greedy decoding
    equals HF's ``generate``, and the log-probs equal an HF forward."""
    engine = EmbeddedEngine(family_model_dirs[kind], seed=0)
    results = engine.generate(PROMPTS, {"max_new_tokens": 8, "top_k": 1, "ignore_eos": True})
    reference = hf_model(family_model_dirs[kind])
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 8) for p in PROMPTS]
    for prompt, result in zip(PROMPTS, results, strict=True):
        want = hf_logprobs(reference, prompt, result["output_ids"], temperature=1.0)
        torch.testing.assert_close(torch.tensor(result["output_logprobs"]), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_sigmoid_routed_moe_generates_as_hf_and_loads_its_routing_bias(kind, tmp_path):
    """GLM-4.5 MoE and DeepSeek-V3 (multi-latent attention): greedy decoding equals HF's; the trainer's export
    includes the router's correction bias (a persistent buffer, not a parameter), and loading it changes the
    engine's routing."""
    import transformers
    from packaging.version import Version
    from safetensors.torch import load_file

    from tiny_models import make_tiny_model

    if Version(transformers.__version__) < Version("5.17"):  # SGLang's environment on the GPU machine has 5.12.1
        pytest.skip(f"transformers {transformers.__version__}: {kind}'s router returns no expert ids before 5.17")
    model_dir = make_tiny_model(kind, tmp_path / kind)
    engine = EmbeddedEngine(model_dir, seed=0)
    greedy = {"max_new_tokens": 8, "top_k": 1, "ignore_eos": True}
    results = engine.generate(PROMPTS, greedy)
    assert [r["output_ids"] for r in results] == [hf_greedy(hf_model(model_dir), p, 8) for p in PROMPTS]
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = load_file(model_dir / "model.safetensors")[name]
    engine.load_weights([(name, -10 * bias)])
    assert [r["output_ids"] for r in engine.generate(PROMPTS, greedy)] != [r["output_ids"] for r in results]
    engine.load_weights([(name, bias)])
    assert [r["output_ids"] for r in engine.generate(PROMPTS, greedy)] == [r["output_ids"] for r in results]


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
    with pytest.raises(ValueError, match=r"sampling_params.temperature \(-1\) must be >= 0"):
        engine.generate(PROMPTS, {"temperature": -1})
    with pytest.raises(ValueError, match=r"keys \['stop_regex'\] must be among"):
        engine.generate(PROMPTS, {"stop_regex": ["\n"]})
    with pytest.raises(ValueError, match=r"sampling_params.stop \(\(''.*must be non-empty strings"):
        engine.generate(PROMPTS, {"stop": ""})
    with pytest.raises(ValueError, match=r"input_ids\[0\] must be a non-empty list"):
        engine.generate([[]], {})


def test_temperature_zero_is_greedy_with_the_logprobs_of_unscaled_logits(tiny_model_dirs):
    """SGLang turns temperature < 1e-6 into (temperature 1, top_k 1): argmax, log_softmax(logits)."""
    params = SamplingParams.from_dict({"temperature": 0.0, "top_k": 50})
    assert (params.temperature, params.top_k, params.greedy) == (1.0, 1, True)
    assert SamplingParams.from_dict({"top_k": 0}).top_k == -1  # HF's "no top-k" in SGLang's spelling
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    results = engine.generate(PROMPTS, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    reference = hf_model(tiny_model_dirs["qwen3"])
    for prompt, result in zip(PROMPTS, results, strict=False):
        assert result["output_ids"] == hf_greedy(reference, prompt, 10)
        want = hf_logprobs(reference, prompt, result["output_ids"], temperature=1.0)
        torch.testing.assert_close(torch.tensor(result["output_logprobs"]), want, rtol=0, atol=1e-5)


def test_stop_string_ends_the_response_on_the_token_that_completes_it(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], seed=0)
    tokenizer = engine.tokenizer
    greedy = hf_greedy(hf_model(tiny_model_dirs["qwen2"]), PROMPTS[1], 20)
    text = tokenizer.decode(greedy)
    stop = text[6:9]  # spans token boundaries (byte-level tokens)
    cut = next(k for k in range(1, 21) if stop in tokenizer.decode(greedy[:k]))
    for params in ({"stop": stop}, {"stop": ["zzz-never", stop], "stop_token_ids": [263]}):
        result = engine.generate(PROMPTS[1:2], {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True, **params})[
            0
        ]
        assert result["output_ids"] == greedy[:cut]
        assert result["finish_reason"] == {"type": "stop", "matched": stop}
        assert len(result["output_logprobs"]) == cut


def test_stop_string_found_after_a_host_sync_cuts_only_its_row(tiny_model_dirs):
    """Stop strings are matched on the host every SYNC_EVERY steps; the row is cut at the exact token."""
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], seed=0)
    new_tokens = 2 * SYNC_EVERY + 8
    greedy = hf_greedy(hf_model(tiny_model_dirs["qwen2"]), PROMPTS[1], new_tokens)
    decode = engine.tokenizer.decode
    head = decode(greedy[: SYNC_EVERY + 3])  # the shortest tail of it not seen one token earlier
    stop = next(head[-n:] for n in range(1, len(head) + 1) if head[-n:] not in decode(greedy[: SYNC_EVERY + 2]))
    cut = next(k for k in range(1, new_tokens + 1) if stop in decode(greedy[:k]))
    assert SYNC_EVERY < cut < new_tokens
    base = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with_stop, without = engine.generate(PROMPTS[1:2] * 2, [dict(base, stop=stop), base])
    assert with_stop["output_ids"] == greedy[:cut] and len(with_stop["output_logprobs"]) == cut
    assert with_stop["finish_reason"] == {"type": "stop", "matched": stop}
    assert without["output_ids"] == greedy and without["finish_reason"]["type"] == "length"
    # the same token is also a stop token: the stop token wins, as SGLang checks it first
    first = greedy.index(greedy[cut - 1]) + 1
    assert not engine.eos_token_ids & set(greedy[:first])
    tie = engine.generate(PROMPTS[1:2], dict(base, ignore_eos=False, stop=stop, stop_token_ids=[greedy[cut - 1]]))[0]
    assert tie["output_ids"] == greedy[:first] and tie["finish_reason"]["matched"] == greedy[cut - 1]


def test_moe_decode_picks_a_capturable_experts_kernel_only_where_the_default_cannot_be_captured(
    tiny_moe_dir, tiny_model_dirs
):
    from rlrun.engine.embedded.engine import CAPTURABLE_DECODE_EXPERTS, _decode_experts_implementation

    moe = hf_model(tiny_moe_dir)
    assert _decode_experts_implementation(moe, torch.device("cuda")) == CAPTURABLE_DECODE_EXPERTS
    assert _decode_experts_implementation(moe, torch.device("cpu")) is None  # nothing is captured on CPU
    assert _decode_experts_implementation(moe.to(torch.bfloat16), torch.device("cuda")) is None  # grouped_mm captures


def test_moe_decode_with_the_capturable_experts_kernel_samples_the_same_tokens(tiny_moe_dir):
    """The decode step's kernel switch (forced on CPU here) changes neither tokens nor log-probs, and prefill
    keeps the load-time kernel."""
    from rlrun.engine.embedded.engine import CAPTURABLE_DECODE_EXPERTS

    params = {"max_new_tokens": 12, "temperature": 1.0, "n": 2, "ignore_eos": True, "sampling_seed": 4}
    default = EmbeddedEngine(tiny_moe_dir, seed=0)
    switched = EmbeddedEngine(tiny_moe_dir, seed=0)
    prefill_kernel = switched.model.config._experts_implementation
    assert prefill_kernel != CAPTURABLE_DECODE_EXPERTS
    switched._decode_experts = CAPTURABLE_DECODE_EXPERTS
    want, got = default.generate(PROMPTS, params), switched.generate(PROMPTS, params)
    assert switched.model.config._experts_implementation == prefill_kernel
    for a, b in zip(want, got, strict=False):
        assert a["output_ids"] == b["output_ids"]
        torch.testing.assert_close(
            torch.tensor(b["output_logprobs"]), torch.tensor(a["output_logprobs"]), rtol=0, atol=1e-5
        )


def test_min_p_removes_tokens_below_a_fraction_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.08], [0.4, 0.35, 0.15, 0.10]])
    rows = [SamplingParams(min_p=0.25), SamplingParams(min_p=0.3, top_k=2)]
    kept = filter_probs(probs, rows)
    # row 0 keeps p >= 0.25 * 0.5; row 1 keeps the top 2 (both >= 0.3 * 0.4)
    assert torch.equal(kept > 0, torch.tensor([[True, True, False, False], [True, True, False, False]]))
    assert torch.equal(kept[kept > 0], probs[kept > 0])


def test_abort_and_pause_act_at_the_next_decode_step(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], seed=0)
    control = DecodeControl()
    params = SamplingParams.from_dict({"max_new_tokens": 400, "ignore_eos": True, "n": 2})
    out: dict = {}
    with control.registered(row_rids(["r"], [params])) as handle:
        assert handle.row_rids == ["r-0", "r-1"]
        control.pause()
        thread = threading.Thread(
            target=lambda: out.update(
                results=engine.generate([PROMPTS[0]], [params], rids=["r"], request=handle, control=control)
            )
        )
        thread.start()
        while not (control.all_parked() and control.num_requests and out == {}):
            time.sleep(0.01)
        time.sleep(0.2)
        assert thread.is_alive() and control.all_parked()  # parked before its first token
        assert control.abort("r-1") == 1 and control.abort("") == 0  # an empty rid alone aborts nothing
        control.resume()
        time.sleep(0.05)
        control.abort("r")
        thread.join(timeout=60)
    first, second = out["results"]
    assert second["output_ids"] == [] and second["finish_reason"] == {"type": "abort", "message": "Aborted"}
    assert first["finish_reason"]["type"] == "abort" and 0 < len(first["output_ids"]) < 400
    assert control.num_requests == 0


@pytest.mark.gpu
def test_bf16_on_the_gpu_samples_hf_greedy_and_releases_its_weights(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], dtype="bfloat16", device="cuda:0")
    results = engine.generate(
        PROMPTS, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2, "sampling_seed": 1}
    )
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"], dtype=torch.bfloat16).cuda().eval()
    for k, result in enumerate(results):
        prompt = PROMPTS[k // 2]
        want = hf_logprobs(reference, prompt, result["output_ids"], temperature=1.0).cpu()
        torch.testing.assert_close(torch.tensor(result["output_logprobs"]), want, rtol=0, atol=0.05)  # bf16
        assert result["output_ids"][0] == hf_greedy(reference, prompt, 1)[0]
    resident = torch.cuda.memory_allocated()
    engine.offload_weights()
    assert torch.cuda.memory_allocated() < resident
    engine.onload_weights()
    assert engine.generate(PROMPTS[:1], {"max_new_tokens": 2, "temperature": 0})[0]["output_ids"]


@pytest.mark.gpu
def test_seeded_sampling_through_the_captured_step_is_reproducible_on_the_gpu(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], dtype="bfloat16", device="cuda:0")
    params = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.9, "n": 4, "sampling_seed": 7, "ignore_eos": True}
    first = engine.generate(PROMPTS, params)
    assert engine.decode_step_captured
    engine.generate(PROMPTS[:1], dict(params, sampling_seed=8))  # another shape in between: a new capture
    again = engine.generate(PROMPTS, params)
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    assert [r["output_logprobs"] for r in first] == [r["output_logprobs"] for r in again]
    assert len({tuple(r["output_ids"]) for r in first[:4]}) > 1
