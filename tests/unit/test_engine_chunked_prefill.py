"""Chunked prefill in the embedded engine (``chunked_prefill_size``): long prompts prefilled in column chunks, each
attending to the cache columns before it. On CPU SDPA splits its sums by query length, so the tokens are the
one-forward prefill's and the log-probs agree to 1e-5; on CUDA the chunks are bitwise the one-forward prefill
(tests/gpu/test_chunked_prefill_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from minimal_config import run_config
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.embedded.static_cache import prefill_mask
from rlrun.preflight.engine import engine_problems

PROMPTS = [[72, 101, 108, 108, 111, 5, 6, 7, 8, 9, 10], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 31]]


def test_a_chunks_mask_is_its_rows_of_the_whole_prefill_mask():
    prompt_mask = torch.tensor([[1] * n + [0] * (9 - n) for n in (9, 3, 1, 6)])
    whole = prefill_mask(prompt_mask)
    assert whole.shape == (4, 1, 9, 9)
    for start, stop in ((0, 9), (0, 2), (2, 4), (4, 9), (7, 9)):
        assert torch.equal(prefill_mask(prompt_mask, start, stop), whole[:, :, start:stop, :stop])


@pytest.mark.slow  # loads models
def test_chunks_cover_the_columns_two_at_least_and_never_one_at_the_end(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, chunked_prefill_size=8)
    assert engine.prefill_chunks(3, 9) == [(0, 2), (2, 4), (4, 6), (6, 9)]  # 8 // 3 = 2 columns; the last 1 merged
    assert engine.prefill_chunks(2, 9) == [(0, 4), (4, 9)]
    assert engine.prefill_chunks(100, 5) == [(0, 2), (2, 5)]  # fewer tokens than prompts: 2 columns a chunk
    assert engine.prefill_chunks(1, 7) == [(0, 7)]
    assert EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0).prefill_chunks(64, 4096) == [(0, 4096)]


@pytest.mark.slow  # loads models
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_p": 0.9}], ids=["greedy", "top_p"]
)
def test_a_chunked_prefill_samples_as_the_one_forward_prefill(tiny_model_dirs, monkeypatch, sampling):
    """Four prompts (3-11 tokens) prefilled two or three columns at a time, with and without continuous batching
    (its refills prefill again): the same tokens and finish reasons, log-probs to 1e-5, and a teacher's scores
    (``score_tokens``, one prompt a prefill) to 1e-5."""
    params = [{"max_new_tokens": n, "n": 2, "sampling_seed": 7 + k, **sampling} for k, n in enumerate((9, 4, 12, 6))]
    whole = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    want = whole.generate(PROMPTS, params)
    calls: list[tuple[int, int, list[tuple[int, int]]]] = []
    for capped in (None, 3):
        calls.clear()
        engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, chunked_prefill_size=4, max_running_requests=capped)
        chunks_of = engine.prefill_chunks
        monkeypatch.setattr(
            engine, "prefill_chunks", lambda p, w: (calls.append((p, w, chunks_of(p, w))), calls[-1][2])[1]
        )
        got = engine.generate(PROMPTS, params)
        assert any(len(chunks) > 1 for _, _, chunks in calls)
        for prompts, width, chunks in calls:  # contiguous, from 0 to the width, 4 // prompts columns (2 at least)
            assert [c[0] for c in chunks] == [0, *(c[1] for c in chunks[:-1])] and chunks[-1][1] == width
            assert all(stop - start <= max(2, 4 // prompts) + 1 for start, stop in chunks)
        for a, b in zip(got, want, strict=True):
            assert a["output_ids"] == b["output_ids"] and a["finish_reason"] == b["finish_reason"]
            torch.testing.assert_close(
                torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]), rtol=0, atol=1e-5
            )
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, chunked_prefill_size=4)
    sequences, starts = [p + [3, 4, 5] for p in PROMPTS], [len(p) for p in PROMPTS]
    for a, b in zip(engine.score_tokens(sequences, starts), whole.score_tokens(sequences, starts), strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


@pytest.mark.slow  # loads models
def test_chunked_prefill_size_is_refused_where_it_cannot_act(tiny_moe_dir, tiny_model_dirs):
    with pytest.raises(ValueError, match=r"chunked_prefill_size \(512\) must be unset for a MoE model"):
        EmbeddedEngine(tiny_moe_dir, chunked_prefill_size=512)
    for bad in (1, 0, "512", 2.5):
        with pytest.raises(ValueError, match=r"must be unset for a MoE model and an integer >= 2"):
            EmbeddedEngine(tiny_model_dirs["qwen3"], chunked_prefill_size=bad)


def test_the_config_takes_it_as_an_embedded_server_argument():
    cfg = run_config({"engine": {"server_args": {"chunked_prefill_size": 8192}}})
    assert cfg.engine.server_args == {"chunked_prefill_size": 8192}
    assert engine_problems(cfg) == []
    [(key, message)] = engine_problems(run_config({"engine": {"server_args": {"chunk_size": 8192}}}))
    assert key == "engine.server_args"
    assert message.startswith("engine.server_args keys ['chunk_size'] must be among ['max_running_requests', 'chunked")
