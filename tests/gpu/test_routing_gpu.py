"""Routed-experts recording inside the embedded engine's CUDA-graph decode step on a real GPU.

The router hooks' copies are captured with the step and replayed with it; the reference is the HF
model's own router over the whole sequence in one eager forward on the same device (fp32).

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_routing_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_captured_decode_step_records_every_forwarded_tokens_experts(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlrun.engine.embedded.engine import EmbeddedEngine
    from rlrun.engine.embedded.routing_record import decode
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("qwen3_moe", tmp_path / "moe", seed=3)
    engine = EmbeddedEngine(model_dir, seed=0, device="cuda")
    prompts = [[5, 17, 99, 3, 42, 7], [11, 12]]
    params = {"max_new_tokens": 40, "temperature": 1.0, "n": 3, "ignore_eos": True, "sampling_seed": 1}
    results = engine.generate(prompts, params)
    assert engine.decode_step_captured
    again = engine.generate(prompts, {**params, "sampling_seed": 2})  # a replay of the same captured graph
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    for b, result in enumerate(results + again):
        tokens = prompts[(b % len(results)) // 3] + result["output_ids"]
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([tokens], device="cuda"), output_router_logits=True)
        reference = torch.stack([logits.softmax(-1).topk(2).indices for logits in out.router_logits], 1)[:-1]
        experts = decode(result["routed_experts"], len(tokens))
        assert torch.equal(experts.sort(-1).values, reference.sort(-1).values.cpu().to(torch.int32)), b


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_decode_step_is_captured_in_each_engine_dtype(tmp_path, dtype):
    """float32 decodes with transformers' batched_mm experts kernel (its grouped_mm cannot be captured there),
    bfloat16 keeps grouped_mm; prefill keeps the load-time kernel in both."""
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from tests.tiny_models import make_tiny_model

    engine = EmbeddedEngine(make_tiny_model("qwen3_moe", tmp_path / "moe", seed=3), dtype=dtype, device="cuda")
    prefill_kernel = engine.model.config._experts_implementation
    engine.generate([[5, 17, 99, 3]], {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True})
    assert engine.decode_step_captured
    assert engine.model.config._experts_implementation == prefill_kernel
