"""The embedded engine's decode reads only the filled cache (read-length buckets), pads rows to a bucket, and
keeps recent batch shapes warm; checked against today's whole-cache decode of the same engine."""

from __future__ import annotations

import pytest
import torch

from rlrun.engine.embedded import decode_graphs
from rlrun.engine.embedded.decode_batch import BatchShape, DecodeBatch, row_bucket
from rlrun.engine.embedded.decode_graphs import WarmBatch, WarmBatches, read_len
from rlrun.engine.embedded.engine import EmbeddedEngine

pytestmark = pytest.mark.slow  # loads models

PROMPTS = [[72, 101, 108, 108, 111], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW_TOKENS = 40
CALLS = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 1.0, "top_p": 0.9, "sampling_seed": 3, "n": 2},
}


def _generate_recording_reads(engine: EmbeddedEngine, params: dict, monkeypatch) -> tuple[list, set[int]]:
    reads: set[int] = set()
    run = WarmBatch.run

    def recording(warm, length):
        reads.add(length)
        run(warm, length)

    monkeypatch.setattr(WarmBatch, "run", recording)
    out = engine.generate(PROMPTS, {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, **params})
    monkeypatch.setattr(WarmBatch, "run", run)
    return out, reads


def test_decode_over_the_filled_columns_equals_the_whole_cache_decode(tiny_model_dirs, monkeypatch):
    """Buckets of 16 columns (three per call here) against reading all 128 columns each step: same tokens,
    same kept sets, log-probs equal to fp32 rounding (CPU SDPA splits its key blocks by key length, so
    the sums may differ in the last bits; on CUDA they are bitwise equal, tests/gpu/test_decode_buckets_gpu.py)."""
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    for name, params in CALLS.items():
        monkeypatch.setattr(decode_graphs, "READ_ALIGN", 10**6)
        whole, whole_reads = _generate_recording_reads(engine, params, monkeypatch)
        monkeypatch.setattr(decode_graphs, "READ_ALIGN", 16)
        filled, filled_reads = _generate_recording_reads(engine, params, monkeypatch)
        max_len = engine._warm.last.batch.cache.max_len
        assert whole_reads == {max_len} == {128}, name
        assert filled_reads == {16, 32, 48}, name  # longest prompt 9 + 39 forwards = 48 columns at most
        for a, b in zip(whole, filled, strict=True):
            assert a["output_ids"] == b["output_ids"] and a.get("kept_ids") == b.get("kept_ids"), name
            torch.testing.assert_close(
                torch.tensor(b["output_logprobs"]), torch.tensor(a["output_logprobs"]), rtol=0, atol=1e-6
            )


def test_read_len_and_row_buckets():
    assert [read_len(f, 384) for f in (1, 128, 129, 300, 384)] == [128, 128, 256, 384, 384]
    assert read_len(129, 200) == 200  # the last bucket is the whole cache
    assert [row_bucket(n) for n in (1, 3, 8, 9, 16, 17, 64, 65, 128)] == [1, 4, 8, 16, 16, 32, 64, 80, 128]


def _warm_batch(num_rows: int, max_len: int) -> WarmBatch:
    shape = BatchShape(num_rows=num_rows, max_len=max_len, stop_width=8, sample=False, filter=False)
    return WarmBatch(DecodeBatch.allocate(shape, torch.device("cpu")), lambda b, n: None, torch.device("cpu"))


def test_warm_batches_keep_recent_shapes_within_count_and_bytes():
    """On CUDA up to MAX_WARM_SHAPES shapes stay (least recently used out first) and the ones not in use hold at
    most their budget (WARM_BYTES, at most WARM_FRACTION of the device); on CPU (nothing captured) only the last
    call's buffers."""
    warm = WarmBatches(torch.device("cuda"))  # the bounds only read the device type; nothing runs on it
    made: list[int] = []

    def make(rows: int) -> WarmBatch:
        made.append(rows)
        return _warm_batch(rows, 128)

    def get(rows: int) -> WarmBatch:
        shape = BatchShape(num_rows=rows, max_len=128, stop_width=8, sample=False, filter=False)
        return warm.get(shape, lambda: make(rows))

    first = get(1)
    for rows in (2, 4, 8):
        get(rows)
    assert get(1) is first  # still warm, now the most recent
    get(16)  # a fifth shape: the least recently used (2 rows) goes
    assert {s.num_rows for s in warm._batches} == {1, 4, 8, 16}
    get(2)
    assert made == [1, 2, 4, 8, 16, 2]  # made again
    budget = get(8).batch.nbytes() + get(16).batch.nbytes()
    warm.budget_bytes = budget
    get(32)  # the others are cut to the budget before the new one is made: 8 and 16 rows stay
    assert [s.num_rows for s in warm._batches] == [8, 16, 32]
    on_cpu = WarmBatches(torch.device("cpu"))
    on_cpu.get(BatchShape(1, 128, 8, False, False), lambda: _warm_batch(1, 128))
    on_cpu.get(BatchShape(2, 128, 8, False, False), lambda: _warm_batch(2, 128))
    assert [s.num_rows for s in on_cpu._batches] == [2]


def test_a_capture_warm_up_mid_call_leaves_no_trace(tiny_model_dirs, monkeypatch):
    """On CUDA a read length's graph is captured the first time a call reaches it, after two real warm-up
    steps on the live buffers; emulated here on CPU (snapshot, two steps, restore), with refilled slots and
    kept sets: the results are those of the call without warm-ups."""
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, max_running_requests=3)
    params = [dict(CALLS["top_p"], max_new_tokens=n, ignore_eos=True) for n in (40, 5, 30)]
    want = engine.generate(PROMPTS, params)
    monkeypatch.setattr(decode_graphs, "READ_ALIGN", 16)
    want_bucketed = engine.generate(PROMPTS, params)
    run, warmed = WarmBatch.run, set()

    def run_after_warm_up(warm, length):
        if length not in warmed:
            warmed.add(length)
            saved = warm.batch.snapshot()
            warm.step(warm.batch, length)
            warm.step(warm.batch, length)
            warm.batch.restore(saved)
        run(warm, length)

    monkeypatch.setattr(WarmBatch, "run", run_after_warm_up)
    got = engine.generate(PROMPTS, params)
    assert warmed == {16, 32, 48}
    for a, b, c in zip(want, want_bucketed, got, strict=True):
        assert a["output_ids"] == b["output_ids"] == c["output_ids"] and a["kept_ids"] == c["kept_ids"]
        assert b["output_logprobs"] == c["output_logprobs"]


def test_dropping_a_warm_batch_frees_its_kv_cache_at_once(tiny_model_dirs):
    """A release (``free_cache`` / ``offload_weights``) and an eviction drop the warm batch, then return the memory
    with ``empty_cache``: the KV cache must be garbage by then, not kept by a reference cycle until a later
    collection (such a cycle through the warm batch once kept a 4B rollout's 78 GB KV cache on the device while
    the trainer trained)."""
    import gc
    import weakref

    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    engine.generate(PROMPTS, {"max_new_tokens": 4, "ignore_eos": True})
    warm = engine._warm.last
    assert warm is not None and warm.graphs  # a step was run through the graph table (eager on CPU)
    kv, batch = weakref.ref(warm.batch.cache.keys[0]), weakref.ref(warm.batch)
    del warm
    gc.collect()
    gc.disable()
    try:
        engine._warm.clear()  # what the CUDA release path runs before empty_cache
        assert batch() is None and kv() is None
    finally:
        gc.enable()
