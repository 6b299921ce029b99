"""The engine contract (shared/reference/sglang-contract.md, section 5), served by a real worker
process, run against both backends: ``embedded`` and ``sglang`` (the SGLang adapter hosting the fake
0.5.23 ``sglang.Engine`` of tests/fakes). References are Hugging Face forwards and greedy decoding."""

from __future__ import annotations

import dataclasses
import io
import re
import threading
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_contract import BACKENDS, hf_greedy, hf_logprobs, spawn_engine, wait_for_inflight
from rlrun.engine.client import EngineOpError
from rlrun.engine.payload import serialize_flattened_bucket
from rlrun.engine.rpc import RpcRemoteError, RpcTimeoutError

pytestmark = pytest.mark.slow

PROMPTS = [[72, 101, 108, 108, 111, 33], [257, 9], [1, 2, 3, 4]]
LONG = {"max_new_tokens": 500, "ignore_eos": True}  # long enough to be caught in flight and paused
SGLANG_NOT_IN_SESSION = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
SGLANG_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
SGLANG_NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, tiny_model_dirs, tmp_path_factory):
    with spawn_engine(
        request.param, tiny_model_dirs["llama"], tmp_path_factory.mktemp(request.param), request_timeout_s=120
    ) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()


def max_logprob_error(model, results, prompts, n: int, temperature: float) -> float:
    return max(
        (torch.tensor(r["output_logprobs"]) - hf_logprobs(model, prompts[k // n], r["output_ids"], temperature))
        .abs()
        .max()
        .item()
        for k, r in enumerate(results)
    )


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run ``fn`` on a thread; the dict gets "result" or "error"."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as exc:  # handed to the test thread
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_generate_groups_with_a_seed_match_hf_logprobs(engine, reference):
    params = {"max_new_tokens": 6, "temperature": 0.8, "n": 3, "sampling_seed": 11}
    results = engine.generate(PROMPTS, params, rids=["a", "b", "c"])
    assert [r["rid"] for r in results] == [f"{p}-{j}" for p in "abc" for j in range(3)]
    for k, r in enumerate(results):
        assert r["prompt_tokens"] == len(PROMPTS[k // 3])
        assert r["completion_tokens"] == len(r["output_ids"]) == len(r["output_logprobs"])
        if r["finish_reason"]["type"] == "stop":
            assert r["output_ids"][-1] == r["finish_reason"]["matched"] and len(r["output_ids"]) <= 6
        else:
            assert r["finish_reason"] == {"type": "length", "length": 6} and len(r["output_ids"]) == 6
    assert [r["output_ids"] for r in engine.generate(PROMPTS, params)] == [r["output_ids"] for r in results]
    assert len({tuple(r["output_ids"]) for r in results[:3]}) > 1  # a group's samples are not copies
    assert max_logprob_error(reference, results, PROMPTS, n=3, temperature=0.8) < 1e-5


def test_temperature_zero_is_hf_greedy_with_unscaled_logprobs(engine, reference):
    results = engine.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "n": 2})
    assert [r["output_ids"] for r in results] == [hf_greedy(reference, p, 8) for p in PROMPTS for _ in range(2)]
    assert max_logprob_error(reference, results, PROMPTS, n=2, temperature=1.0) < 1e-5  # SGLang: T=0 -> T=1, top_k=1


def test_stop_strings_end_the_response_at_the_match(engine, reference, tiny_model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    greedy = hf_greedy(reference, PROMPTS[0], 16)
    stop = tokenizer.decode(greedy[5:7])
    cut = next(k for k in range(1, 17) if stop in tokenizer.decode(greedy[:k]))  # first token completing it
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": ["never-generated", stop]}
    result = engine.generate(PROMPTS[:1], params)[0]
    assert result["output_ids"] == greedy[:cut] and cut < 16
    assert result["finish_reason"] == {"type": "stop", "matched": stop}
    assert tokenizer.decode(result["output_ids"]).endswith(stop)


def test_abort_returns_partial_output_for_matching_rids_only(engine):
    params = [dict(LONG), {"max_new_tokens": 5, "ignore_eos": True}]
    thread, out = in_background(engine.generate, PROMPTS[:2], params, rids=["drop", "keep"])
    wait_for_inflight(engine, out)
    engine.pause_generation("in_place")  # hold the request so that the aborts surely find it in flight
    engine.abort("no-such-rid")
    engine.abort("dr")  # a prefix, as SGLang's scheduler matches
    engine.continue_generation()
    thread.join(timeout=60)
    dropped, kept = out["result"]
    assert dropped["finish_reason"]["type"] == "abort" and len(dropped["output_ids"]) < 500
    assert len(dropped["output_logprobs"]) == dropped["completion_tokens"] == len(dropped["output_ids"])
    assert kept["finish_reason"] == {"type": "length", "length": 5}


def test_pause_in_abort_mode_returns_in_flight_requests_and_refuses_new_ones(engine):
    thread, out = in_background(engine.generate, PROMPTS[:1], LONG)
    wait_for_inflight(engine, out)
    engine.pause_generation("in_place")  # held, then aborted by the abort-mode pause
    engine.pause_generation("abort")
    assert engine.health()["num_inflight"] == 0 and engine.health()["state"] == "paused"
    thread.join(timeout=60)
    assert out["result"][0]["finish_reason"]["type"] == "abort"
    with pytest.raises(RpcRemoteError, match="generate must not run while generation is paused"):
        engine.generate(PROMPTS[:1], {"max_new_tokens": 2})
    engine.continue_generation()
    assert len(engine.generate(PROMPTS[:1], {"max_new_tokens": 2, "ignore_eos": True})[0]["output_ids"]) == 2


def test_request_held_by_an_in_place_pause_hits_the_call_timeout(engine, reference):
    """A call the worker never finishes fails after its timeout (the worker still answers heartbeats);
    while paused in place, weights can be updated, and the held request resumes on continue."""
    thread, out = in_background(
        engine.rpc.call,
        "generate",
        timeout_s=3.0,
        input_ids=PROMPTS[:1],
        sampling_params=LONG,
        return_logprob=True,
        rids=None,
    )
    wait_for_inflight(engine, out)
    engine.pause_generation("in_place")
    thread.join(timeout=60)
    assert isinstance(out.get("error"), RpcTimeoutError), out
    assert "although the worker still answers heartbeats" in str(out["error"])
    assert engine.health()["num_inflight"] == 1  # held, not lost
    params = [(name, p.detach().clone()) for name, p in reference.named_parameters()]
    engine.update_weights(params, weight_version="while-paused", bucket_bytes=2**30)
    engine.continue_generation()
    while engine.health()["num_inflight"]:
        threading.Event().wait(0.05)
    assert engine.get_weight_version() == "while-paused"


def test_weight_update_changes_logprobs_to_the_new_weights(engine, reference):
    g = torch.Generator().manual_seed(3)
    original = [(name, p.detach().clone()) for name, p in reference.named_parameters()]
    perturbed = [(name, t + 0.05 * torch.randn(t.shape, generator=g)) for name, t in original]
    target = AutoModelForCausalLM.from_config(reference.config).eval()
    target.load_state_dict(dict(perturbed), strict=False)  # tied: lm_head follows embed_tokens
    total_bytes = sum(t.numel() * t.element_size() for _, t in perturbed)
    try:
        stats = engine.update_weights(perturbed, weight_version="step-1", bucket_bytes=64 * 1024)
        assert stats["num_buckets"] > 1 and stats["num_bytes"] == total_bytes
        assert engine.get_weight_version() == "step-1"
        params = {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "sampling_seed": 5}
        results = engine.generate(PROMPTS, params)
        assert {r["weight_version"] for r in results} == {"step-1"}
        assert max_logprob_error(target, results, PROMPTS, n=2, temperature=1.0) < 1e-5
        assert max_logprob_error(reference, results, PROMPTS, n=2, temperature=1.0) > 1e-2  # the update did something
    finally:
        engine.update_weights(original, weight_version="restored", bucket_bytes=2**30)


def test_update_session_rules_come_back_with_sglang_messages(engine):
    payload = serialize_flattened_bucket([("model.norm.weight", torch.ones(64))])
    assert engine.update_weights_from_tensor([payload]) == {"success": False, "message": SGLANG_NOT_IN_SESSION}
    assert engine.end_weight_update() == {"success": False, "message": SGLANG_NO_SESSION}
    assert engine.begin_weight_update()["success"] is True
    assert engine.begin_weight_update() == {"success": False, "message": SGLANG_ALREADY_OPEN}
    refused = engine.update_weights_from_tensor([payload, payload])
    assert refused["success"] is False and "one payload per engine TP rank (1)" in refused["message"]
    assert engine.end_weight_update()["success"] is True
    assert engine.health()["in_update_session"] is False


@dataclasses.dataclass
class OwnMetadata:
    """Metadata defined outside SGLang's unpickling allowlist."""

    name: str


def test_payload_with_a_global_off_sglangs_allowlist_is_refused_and_the_engine_survives(engine):
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [OwnMetadata("x")]})
    assert engine.begin_weight_update()["success"]
    result = engine.update_weights_from_tensor([buf.getvalue()])
    assert engine.end_weight_update()["success"]
    assert result["success"] is False and "OwnMetadata" in result["message"]
    assert re.search(r"Blocked unsafe global|unpickling allowlist", result["message"])
    assert engine.health()["state"] == "ready"


def test_unknown_weight_names(engine):
    """The embedded engine refuses a name its model lacks; SGLang skips it with a warning (its
    ``load_weights`` logs "Parameter ... not found in params_dict"), and so does the adapter."""
    if engine.spec.backend == "embedded":
        with pytest.raises(EngineOpError, match="weight model.nope must be a parameter"):
            engine.update_weights([("model.nope", torch.zeros(2))], weight_version="bad", bucket_bytes=1024)
        assert engine.get_weight_version() != "bad"
    else:
        engine.update_weights([("model.nope", torch.zeros(2))], weight_version="skipped", bucket_bytes=1024)
        assert "Parameter model.nope not found in params_dict" in engine.log_path.read_text()
    assert engine.health()["in_update_session"] is False  # the sync closed its session either way


def test_release_resume_rules_in_the_per_step_order(engine, reference):
    """release all -> resume weights -> sync -> resume kv_cache + cuda_graph -> generate. Without
    the sync, SGLang's weights would be garbage after the resume (the fake fills them with NaN)."""
    thread, out = in_background(engine.generate, PROMPTS[:1], LONG)
    wait_for_inflight(engine, out)
    engine.pause_generation("in_place")
    with pytest.raises(RpcRemoteError, match=r"must not run with 1 request\(s\) in flight"):
        engine.release_memory_occupation()  # SGLang would die here; the worker refuses
    engine.abort(abort_all=True)
    thread.join(timeout=60)
    engine.continue_generation()
    engine.release_memory_occupation()
    assert engine.health()["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(RpcRemoteError, match="generate must not run while memory tags"):
        engine.generate(PROMPTS, {"max_new_tokens": 2})
    engine.resume_memory_occupation(["weights"])
    with pytest.raises(RpcRemoteError, match=r"tags \['weights'\] must follow their release"):
        engine.resume_memory_occupation(["weights"])
    original = [(name, p.detach().clone()) for name, p in reference.named_parameters()]
    engine.update_weights(original, weight_version="after-release", bucket_bytes=2**30)
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    results = engine.generate(PROMPTS, {"max_new_tokens": 4, "sampling_seed": 1})
    assert max_logprob_error(reference, results, PROMPTS, n=1, temperature=1.0) < 1e-5


def test_sync_can_be_verified_by_weight_checksums(engine, reference):
    original = [(name, p.detach().clone()) for name, p in reference.named_parameters()]
    if engine.spec.backend == "sglang":
        with pytest.raises(RpcRemoteError, match="NotImplementedError"):
            engine.weight_checksums()
        return
    engine.update_weights(original, weight_version="verified", bucket_bytes=64 * 1024, verify=True)
    with pytest.raises(EngineOpError, match=r"differ from the trainer's .* 1 of 1 tensors"):
        engine._verify({"model.norm.weight": "0" * 64}, "forged")
