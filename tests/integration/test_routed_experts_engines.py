"""Routed experts over the engine RPC from both backends (real worker processes): the embedded engine,
and the SGLang adapter over the fake (0.5.17 and 0.5.23 modes) started with
``enable_return_routed_experts``. Each sample's experts equal the HF router's over prompt + output;
without the server flag SGLang returns none (and the adapter does not ask)."""

from __future__ import annotations

import pytest
import torch

from engine_contract import spawn_engine
from rlrun.engine.embedded.routing_record import decode
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13]]
PARAMS = {"max_new_tokens": 8, "temperature": 1.0, "n": 2, "sampling_seed": 4}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=5)


def _check_against_hf(model_dir, results) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for b, result in enumerate(results):
        tokens = PROMPTS[b // PARAMS["n"]] + result["output_ids"]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
        reference = torch.stack([lg.softmax(-1).topk(2).indices for lg in out.router_logits], 1)[:-1].sort(-1).values
        assert torch.equal(decode(result["routed_experts"], len(tokens)).sort(-1).values, reference.to(torch.int32))


@pytest.mark.parametrize("backend,version", [("embedded", None), ("sglang", "0.5.17"), ("sglang", "0.5.23")])
def test_engine_returns_routed_experts_over_rpc(moe_dir, tmp_path, backend, version):
    kwargs = (
        {}
        if backend == "embedded"
        else {
            "fake_version": version,
            "server_args": {"enable_deterministic_inference": True, "enable_return_routed_experts": True},
        }
    )
    with spawn_engine(backend, moe_dir, tmp_path, **kwargs) as client:
        results = client.generate(PROMPTS, PARAMS)
    _check_against_hf(moe_dir, results)


def test_sglang_without_the_server_flag_returns_no_routing(moe_dir, tmp_path):
    with spawn_engine("sglang", moe_dir, tmp_path) as client:
        results = client.generate(PROMPTS, PARAMS)
    assert all("routed_experts" not in r for r in results)
