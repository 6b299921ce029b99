"""The embedded engine records every forwarded token's experts (SGLang's ``routed_experts``), checked
against the HF model's own router run over the whole sequence (prompt + output) in one eager forward."""

import pytest
import torch

from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.embedded.routing_record import decode, encode
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=3)


def _hf_topk(model_dir, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), layers, topk] expert ids from HF's router logits (softmax, top-k), sorted per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.softmax(-1).topk(k).indices for logits in out.router_logits], dim=1).sort(-1).values


def test_engine_routing_equals_hf_router_for_every_forwarded_token(moe_dir):
    engine = EmbeddedEngine(moe_dir, seed=0)
    prompts = [[5, 17, 99, 3, 42, 7], [11, 12]]  # different lengths: left padding in the prefill
    results = engine.generate(
        prompts, {"max_new_tokens": 20, "temperature": 1.0, "n": 2, "ignore_eos": True, "sampling_seed": 1}
    )
    assert len(results) == 4
    for b, result in enumerate(results):
        tokens = prompts[b // 2] + result["output_ids"]
        experts = decode(result["routed_experts"], len(tokens))
        assert experts.shape == (len(tokens) - 1, 2, 2)
        reference = _hf_topk(moe_dir, tokens)[:-1]
        assert torch.equal(experts.sort(-1).values, reference.to(torch.int32)), b


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_sigmoid_routers_are_recorded(kind, tmp_path):
    """GLM-4.5 / DeepSeek-V3 routers (``*TopkRouter``, sigmoid + correction bias) are recorded too: the ids equal
    what HF's own routers pick over the whole sequence; layer 0 is dense, so one MoE layer is recorded."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(kind, tmp_path / kind, seed=3)
    engine = EmbeddedEngine(model_dir, seed=0)
    prompt = [5, 17, 99, 3, 42, 7]
    result = engine.generate([prompt], {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})[0]
    tokens = prompt + result["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    picked = []
    for module in model.modules():
        if type(module).__name__.endswith("TopkRouter"):
            module.register_forward_hook(lambda _m, _a, out: picked.append(out[2].sort(-1).values))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    experts = decode(result["routed_experts"], len(tokens))
    topk = model.config.num_experts_per_tok
    assert experts.shape == (len(tokens) - 1, 1, topk)
    assert torch.equal(experts.sort(-1).values[:, 0], picked[0][:-1].to(torch.int32))


def test_routing_encoding_round_trips_sglang_form():
    experts = torch.randint(0, 128, (9, 3, 8), dtype=torch.int32)
    assert torch.equal(decode(encode(experts), num_tokens=10), experts)
    with pytest.raises(ValueError, match="num_tokens - 1"):
        decode(encode(experts), num_tokens=8)


def test_dense_model_records_nothing(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"])
    assert engine.router_recorder is None
    (result,) = engine.generate([[1, 2, 3]], {"max_new_tokens": 3})
    assert "routed_experts" not in result


def test_sglang_adapter_reads_meta_info_routed_experts():
    from rlrun.engine.backends.sglang import to_gen_result

    experts = torch.randint(0, 8, (5, 2, 2), dtype=torch.int32)
    meta = {
        "id": "r",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "weight_version": "default",
        "routed_experts": encode(experts)["data"],
    }
    result = to_gen_result({"output_ids": [1, 2, 3], "meta_info": meta}, "r", False, routed_topk=2)
    assert torch.equal(decode(result["routed_experts"], 6), experts)
    assert "routed_experts" not in to_gen_result({"output_ids": [1, 2, 3], "meta_info": meta}, "r", False)


def test_routers_of_an_older_transformers_are_refused_with_the_reason(tmp_path):
    """transformers 5.12.1's GLM-4 MoE and DeepSeek-V3 routers return only their logits (and DeepSeek's has no
    top_k): the engine says so instead of recording the wrong tensor (seen on the H200 under SGLang's pin)."""
    from transformers import AutoModelForCausalLM

    from rlrun.engine.embedded.routing_record import RouterContractError, RouterRecorder

    model_dir = make_tiny_model("glm4_moe", tmp_path / "glm4_moe", seed=3)
    engine = EmbeddedEngine(model_dir, seed=0)
    for module in engine.model.modules():
        if type(module).__name__.endswith("TopkRouter"):
            module.forward = lambda hidden, weight=module.weight: hidden.view(-1, weight.shape[1]) @ weight.T
    with pytest.raises(RouterContractError, match=r"Glm4MoeTopkRouter \(transformers .*\) returns no \(logits"):
        engine.generate([[5, 17, 99]], {"max_new_tokens": 2, "ignore_eos": True})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for module in model.modules():
        if type(module).__name__.endswith("TopkRouter"):
            del module.top_k
    with pytest.raises(RouterContractError, match="has no top_k, so the embedded engine cannot record"):
        RouterRecorder.attach(model)
