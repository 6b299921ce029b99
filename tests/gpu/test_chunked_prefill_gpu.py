"""On a GPU, a prefill in column chunks (``chunked_prefill_size``) is bitwise the one-forward prefill in bf16: each
chunk's queries attend to the columns before them under the same kernel, keys in the same blocks from column 0. In
fp32 it is not (H200, 2026-12-03: the same tokens, a log-prob 4.8e-7 apart): some fp32 kernel of a call with fewer
rows rounds differently (which one is not identified), so fp32 is held to the tokens and 1e-6.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_chunked_prefill_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_chunked_prefill_is_bitwise_the_one_forward_prefill(tmp_path, dtype):
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("qwen3", tmp_path / "m", seed=2)
    prompts = [[3 + (k * 7 + n) % 250 for k in range(n)] for n in (297, 3, 130, 201)]  # the tiny model's 264 ids
    params = {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.95, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    whole = EmbeddedEngine(model, seed=0, dtype=dtype, device="cuda")
    chunked = EmbeddedEngine(model, seed=0, dtype=dtype, device="cuda", chunked_prefill_size=256)
    assert len(chunked.prefill_chunks(len(prompts), 297)) == 5  # 64 columns a chunk, the last 41
    exact = dtype == "bfloat16"
    for a, b in zip(whole.generate(prompts, params), chunked.generate(prompts, params), strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert_same(a["output_logprobs"], b["output_logprobs"], exact)
    sequences, starts = [p + [1, 2, 3] for p in prompts], [len(p) for p in prompts]
    for a, b in zip(whole.score_tokens(sequences, starts), chunked.score_tokens(sequences, starts), strict=True):
        assert_same(a, b, exact)


def assert_same(a: list[float], b: list[float], exact: bool) -> None:
    if exact:
        assert a == b
    else:
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)
