"""A decode step's attention by key counts (``attention_kernel.decode``: the cache as packed views, each row reading
its own columns, no mask bias), which the embedded engine runs on CUDA. The kernel is CUDA-only; here its inputs
are checked (the packed views, the counts, the per-forward sharing, the kernel's schema on meta tensors) and its
call is replaced by SDPA over exactly the positions it would read, so a whole engine run checks the rest. That
the kernel's rows are bitwise the trainer's is measured on the H200 (benchmarks/decode_attention.py) and tested
in tests/gpu/test_decode_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlrun.engine.embedded import decode_graphs, decode_run, static_cache
from rlrun.engine.embedded.decode_batch import row_bucket
from rlrun.engine.embedded.decode_graphs import WarmBatch
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.kernels import attention as attention_kernel
from rlrun.kernels.attention import DecodeRows, decode, positions_per_row


def test_packed_positions_are_each_rows_columns_of_a_cache_slice():
    """Packed position ``key_starts[b] + p`` of head j is row b's column p of head j, for a slice of the read
    columns and for the first rows of a batch (a shrunk tail's views), as the kernel reads them."""
    buffer = torch.randn(5, 3, 40, 8)  # [rows, kv heads, max_len, dim]
    for view in (buffer[:, :, :24], buffer[:2, :, :16], buffer):
        per_row = positions_per_row(view)
        assert per_row == 3 * 40
        packed = attention_kernel._packed_positions(view, per_row)
        rows = DecodeRows.of(torch.ones(view.shape[0], 1, 1, view.shape[2], dtype=torch.bool), 2, per_row)
        for b in range(view.shape[0]):
            start = int(rows.key_starts[b])
            assert torch.equal(packed[0, start : start + view.shape[2]], view[b].transpose(0, 1))
    assert positions_per_row(buffer.transpose(1, 2)) is None  # heads inside positions: not a cache view
    assert positions_per_row(buffer[..., :4]) is None  # a part of each position


def test_decode_rows_count_each_masks_columns():
    mask = torch.zeros(3, 1, 1, 10, dtype=torch.bool)
    for row, n in enumerate((1, 7, 10)):
        mask[row, ..., :n] = True
    rows = DecodeRows.of(mask, groups=4, positions_per_row=96)
    assert rows.key_counts.tolist() == [1, 7, 10] and rows.key_counts.dtype == torch.int32
    assert rows.query_starts.tolist() == [0, 4, 8, 12] and rows.key_starts.tolist() == [0, 96, 192, 288]


def test_decode_fits_the_kernel_schema_on_meta_tensors():
    """The kernel call's argument order, dtypes and shape rules (its meta kernel), with grouped heads and a value
    narrower than the key (multi-latent attention): out comes ``[B, 1, H, D_v]``."""
    batch, heads, kv_heads, length = 4, 16, 8, 256
    query = torch.empty(batch, heads, 1, 192, device="meta", dtype=torch.bfloat16)
    key = torch.empty(batch, kv_heads, 384, 192, device="meta", dtype=torch.bfloat16)[:, :, :length]
    value = torch.empty(batch, kv_heads, 384, 128, device="meta", dtype=torch.bfloat16)[:, :, :length]
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device="meta")
    out = decode(query, key, value, DecodeRows.of(mask, heads // kv_heads, positions_per_row(key)), scale=0.1)
    assert out.shape == (batch, 1, heads, 128) and out.dtype == torch.bfloat16


def _packed_sdpa(query, key, value, query_starts, key_starts, max_queries, max_keys, scale, key_counts):
    """What the kernel computes, on CPU: sequence b's queries over its ``key_counts[b]`` keys from ``key_starts[b]``."""
    out = query.new_zeros(*query.shape[:-1], value.shape[-1])
    for b in range(len(key_counts)):
        q0, q1, k0, n = int(query_starts[b]), int(query_starts[b + 1]), int(key_starts[b]), int(key_counts[b])
        assert q1 - q0 <= max_queries and 1 <= n <= max_keys
        q, k, v = (
            t[0, s : s + size].transpose(0, 1) for t, s, size in ((query, q0, q1 - q0), (key, k0, n), (value, k0, n))
        )
        out[0, q0:q1] = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return out


@pytest.mark.slow  # loads a model
def test_an_engine_decoding_by_key_counts_samples_as_under_the_mask(tiny_model_dirs, monkeypatch):
    """The CUDA path emulated on CPU through continuous batching (10 samples through 3 slots in a bucket of 4,
    refilled as rows end): tokens and log-probs are the masked path's; every decode forward builds its
    DecodeRows once (a prefill its bias once), from a mask that is a prefix of each row's cache columns (what the
    counts assume), every forward hands attention the whole cache (one captured step, not one per read length),
    and nothing is held after a forward."""
    monkeypatch.setattr(decode_run, "num_slots", lambda n, device: row_bucket(n))
    monkeypatch.setattr(decode_graphs, "READ_ALIGN", 16)  # read lengths 16, 32, 48 on the masked path
    prompts = [[72, 101, 108, 108, 111], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 31], [200, 201, 202, 203]]
    params = [
        {"max_new_tokens": n, "n": 2, "sampling_seed": 11 + k, "temperature": 1.0}
        for k, n in enumerate((37, 3, 20, 9, 26))
    ]
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, max_running_requests=3)
    want = engine.generate(prompts, params)

    built: dict[str, int] = {"bias": 0, "rows": 0}
    make_rows, make_bias = DecodeRows.of, static_cache.mask_bias

    def rows_of(mask, groups, per_row):
        built["rows"] += 1
        rows = make_rows(mask, groups, per_row)
        columns = torch.arange(mask.shape[-1])
        assert torch.equal(mask.reshape(mask.shape[0], -1), columns < rows.key_counts[:, None])  # prefixes
        return rows

    monkeypatch.setattr(static_cache, "uses_shared_kernel", lambda query, value: True)
    monkeypatch.setattr(static_cache.StaticKVCache, "reads_by_count", True)
    lengths: set[int] = set()
    run = WarmBatch.run
    monkeypatch.setattr(WarmBatch, "run", lambda warm, n: (lengths.add(n), run(warm, n))[1])
    monkeypatch.setattr(
        static_cache,
        "mask_bias",
        lambda mask, dtype: (built.__setitem__("bias", built["bias"] + 1), make_bias(mask, dtype))[1],
    )
    monkeypatch.setattr(static_cache.DecodeRows, "of", staticmethod(rows_of))
    monkeypatch.setattr(attention_kernel, "_packed_attention", _packed_sdpa)
    forwards = {"prefill": 0, "decode": 0}
    forward = engine._forward
    monkeypatch.setattr(
        engine,
        "_forward",
        lambda ids, *rest: (forwards.__setitem__("decode", forwards["decode"] + 1), forward(ids, *rest))[1],
    )
    prefill = engine._prefill_hidden
    monkeypatch.setattr(
        engine,
        "_prefill_hidden",
        lambda p, *rest: (forwards.__setitem__("prefill", forwards["prefill"] + 1), prefill(p, *rest))[1],
    )
    got = engine.generate(prompts, params)
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"] and a["finish_reason"] == b["finish_reason"]
        torch.testing.assert_close(
            torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]), rtol=0, atol=1e-5
        )
    assert built == {"bias": forwards["prefill"], "rows": forwards["decode"]} and forwards["decode"] > 20
    assert lengths == {engine._warm.last.batch.cache.max_len}  # one captured step for every fill level
    assert static_cache._forward_state.built == {}
