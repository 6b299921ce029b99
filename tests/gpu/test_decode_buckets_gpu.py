"""On a GPU, the decode step by key counts (one captured graph for every fill level) is bitwise the masked decode
over the filled cache columns (read-length buckets, one captured graph each) and over the whole cache, and a batch
shape's graphs stay warm across calls of other shapes.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_decode_buckets_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_by_key_counts_is_bitwise_the_masked_decode_bucketed_or_whole_and_stays_warm(
    tmp_path, monkeypatch, dtype
):
    from rlrun.engine.embedded import decode_graphs, static_cache
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from tests.tiny_models import make_tiny_model

    engine = EmbeddedEngine(make_tiny_model("qwen3", tmp_path / "m", seed=2), seed=0, dtype=dtype, device="cuda")
    prompts = [list(range(3, 140)), [7, 8, 9], list(range(20, 90))]  # 137 tokens: reads start past one bucket
    params = {"max_new_tokens": 300, "temperature": 1.0, "top_p": 0.95, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    with monkeypatch.context() as masked_path:  # the masked decode: attention under the mask bias, read buckets
        masked_path.setattr(static_cache, "positions_per_row", lambda cache: None)
        masked_path.setattr(static_cache.StaticKVCache, "reads_by_count", False)
        masked_path.setattr(decode_graphs, "READ_ALIGN", 10**6)
        whole = engine.generate(prompts, params)
        engine.free_cache()
        masked_path.setattr(decode_graphs, "READ_ALIGN", 128)
        filled = engine.generate(prompts, params)
        assert sorted(engine._warm.last.graphs) == [256, 384, 512]
        engine.free_cache()
    by_count = engine.generate(prompts, params)
    warm = engine._warm.last
    assert warm.batch.cache.reads_by_count and sorted(warm.graphs) == [512] and warm.captured
    engine.generate(prompts[:1], {**params, "n": 1})  # another shape in between
    again = engine.generate(prompts, params)
    assert engine._warm.last is warm  # the same buffers and graph, replayed
    for a, b, c, d in zip(whole, filled, by_count, again, strict=True):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"] == d["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"] == c["output_logprobs"] == d["output_logprobs"]


def test_a_long_tail_goes_on_in_a_smaller_captured_batch_with_the_whole_batchs_tokens(tmp_path, monkeypatch):
    """32 rows, 8 of them long: at the look after 32 forwards the 8 long rows move into the first slots of a batch of
    16 (views of the same buffers, its own captured steps) and run to the end there. In fp32 the tokens are the whole
    batch's, and the log-probs agree to GEMM rounding (cuBLAS may tile 16 rows and 32 rows differently); a second
    call replays the same smaller batch's graphs."""
    from rlrun.engine.embedded import decode_run
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from tests.tiny_models import make_tiny_model

    engine = EmbeddedEngine(make_tiny_model("qwen3", tmp_path / "m", seed=2), seed=0, dtype="float32", device="cuda")
    prompts = [list(range(3 + k, 40 + 3 * k)) for k in range(8)]
    params = [
        {"max_new_tokens": 200 if k >= 6 else 20, "temperature": 1.0, "n": 4, "sampling_seed": k, "ignore_eos": True}
        for k in range(8)
    ]
    monkeypatch.setattr(decode_run, "SHRINK_MIN_ROWS", 10**6)
    whole = engine.generate(prompts, params)
    monkeypatch.setattr(decode_run, "SHRINK_MIN_ROWS", 16)
    shrunk = engine.generate(prompts, params)
    warm = engine._warm.last
    assert sorted(warm.heads) == [16] and warm.heads[16].captured
    graphs = dict(warm.heads[16].graphs)
    again = engine.generate(prompts, params)
    assert warm.heads[16].graphs == graphs  # replayed, none captured anew
    for a, b, c in zip(whole, shrunk, again, strict=True):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"]
        assert b["output_logprobs"] == c["output_logprobs"]
        torch.testing.assert_close(
            torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]), rtol=0, atol=1e-4
        )
