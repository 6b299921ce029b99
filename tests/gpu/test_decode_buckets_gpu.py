"""On a GPU, the decode step over the filled cache columns (read-length buckets, one captured graph each) is
bitwise the whole-cache decode, and a batch shape's graphs stay warm across calls of other shapes.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_buckets_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bucketed_decode_is_bitwise_the_whole_cache_decode_and_stays_warm(tmp_path, monkeypatch, dtype):
    from rlrun.engine.backends import decode_graphs
    from rlrun.engine.backends.embedded import EmbeddedEngine
    from tests.tiny_models import make_tiny_model

    engine = EmbeddedEngine(make_tiny_model("qwen3", tmp_path / "m", seed=2), seed=0, dtype=dtype, device="cuda")
    prompts = [list(range(3, 140)), [7, 8, 9], list(range(20, 90))]  # 137 tokens: reads start past one bucket
    params = {"max_new_tokens": 300, "temperature": 1.0, "top_p": 0.95, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    monkeypatch.setattr(decode_graphs, "READ_ALIGN", 10**6)
    whole = engine.generate(prompts, params)
    engine.free_cache()
    monkeypatch.setattr(decode_graphs, "READ_ALIGN", 128)
    filled = engine.generate(prompts, params)
    warm = engine._warm.last
    assert sorted(warm.graphs) == [256, 384, 512] and warm.captured
    engine.generate(prompts[:1], {**params, "n": 1})  # another shape in between
    again = engine.generate(prompts, params)
    assert engine._warm.last is warm  # the same buffers and graphs, replayed
    for a, b, c in zip(whole, filled, again, strict=True):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"] == c["output_logprobs"]
