"""Continuous batching in the embedded engine: with fewer slots than samples, waiting samples take the slots of
ended ones, and every sample's tokens are what it samples alone (same seed), in fp32 on CPU."""

from __future__ import annotations

import pytest
import torch

from rlrun.engine.embedded import decode_run
from rlrun.engine.embedded.decode_batch import row_bucket
from rlrun.engine.embedded.decode_control import RequestHandle
from rlrun.engine.embedded.decode_graphs import WarmBatch
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.engine.kept_set import decode_kept_ids
from rlrun.engine.sampling import SamplingParams, row_rids

pytestmark = pytest.mark.slow  # loads models

PROMPTS = [[72, 101, 108, 108, 111], [257, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9], [30, 31], [200, 201, 202, 203]]
LENGTHS = [37, 3, 20, 9, 26]  # a long tail: the long rows keep their slots while short ones come and go


def _params(sampling: dict) -> list[dict]:
    return [{"max_new_tokens": n, "n": 2, "sampling_seed": 11 + k, **sampling} for k, n in enumerate(LENGTHS)]


def _kept_sets(result: dict) -> list[set[int]] | None:
    if "kept_ids" not in result:
        return None
    kept = decode_kept_ids(result["kept_ids"], len(result["output_ids"]))
    return [set(row[row >= 0].tolist()) for row in kept]


def _rows_per_forward(monkeypatch) -> list[int]:
    """The rows of the batch each decode forward runs, appended from now on."""
    rows: list[int] = []
    run = WarmBatch.run
    monkeypatch.setattr(WarmBatch, "run", lambda warm, n: (rows.append(warm.batch.num_rows), run(warm, n)))
    return rows


def _assert_same(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a["output_ids"] == b["output_ids"] and a["finish_reason"] == b["finish_reason"]
        assert _kept_sets(a) == _kept_sets(b)  # as sets: fp32 rounding across batch sizes may swap two near ties
        torch.testing.assert_close(
            torch.tensor(a["output_logprobs"]), torch.tensor(b["output_logprobs"]), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}], ids=["plain", "top_p"])
def test_waiting_samples_take_ended_slots_and_sample_as_alone(tiny_model_dirs, monkeypatch, sampling):
    """10 samples through 3 slots (a bucket of 4, one kept empty) against the uncapped engine and against each
    prompt alone: same tokens, finish reasons and kept sets; the capped engine never ran more than 4 rows and
    prefilled each prompt once."""
    monkeypatch.setattr(decode_run, "num_slots", lambda n, device: row_bucket(n))  # padding rows as on CUDA
    model = tiny_model_dirs["qwen3"]
    uncapped, capped = EmbeddedEngine(model, seed=0), EmbeddedEngine(model, seed=0, max_running_requests=3)
    shapes = _rows_per_forward(monkeypatch)
    params = _params(sampling)
    want = uncapped.generate(PROMPTS, params)
    assert set(shapes) == {16}
    shapes.clear()
    prefilled: list[list[int]] = []
    prefill = capped._prefill
    monkeypatch.setattr(capped, "_prefill", lambda prompts: (prefilled.extend(prompts), prefill(prompts))[1])
    got = capped.generate(PROMPTS, params)
    assert sorted(prefilled) == sorted(PROMPTS)  # each prompt once: a group split between refills reuses its K/V
    assert set(shapes) == {4} and len(shapes) < 75  # 190 tokens over 3 slots; 105 in batches of 3 without refills
    _assert_same(got, want)
    alone = [r for prompt, p in zip(PROMPTS, params, strict=True) for r in uncapped.generate([prompt], p)]
    _assert_same(got, alone)


def test_a_sample_aborted_while_waiting_ends_without_tokens(tiny_model_dirs):
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0, max_running_requests=2)
    params = [SamplingParams.from_dict(p) for p in _params({"temperature": 1.0})]
    handle = RequestHandle(row_rids([f"r{k}" for k in range(len(PROMPTS))], params))
    handle.aborted[0] = handle.aborted[7] = True  # one in the first slots, one waiting
    got = engine.generate(PROMPTS, params, rids=[f"r{k}" for k in range(len(PROMPTS))], request=handle)
    want = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0).generate(PROMPTS, params)
    for k in (0, 7):
        assert got[k]["output_ids"] == [] and got[k]["finish_reason"] == {"type": "abort", "message": "Aborted"}
        assert got[k]["rid"] == handle.row_rids[k] and got[k]["completion_tokens"] == 0
    _assert_same([r for k, r in enumerate(got) if k not in (0, 7)], [r for k, r in enumerate(want) if k not in (0, 7)])


def test_max_running_requests_is_refused_where_it_cannot_act(tiny_moe_dir, tiny_model_dirs):
    with pytest.raises(ValueError, match=r"max_running_requests \(2\) must be unset for a MoE model"):
        EmbeddedEngine(tiny_moe_dir, max_running_requests=2)
    with pytest.raises(
        ValueError, match=r"max_running_requests \(0\) must be unset for a MoE model and an integer >= 1"
    ):
        EmbeddedEngine(tiny_model_dirs["qwen3"], max_running_requests=0)


TAIL = [3, 9, 20, 26, 53]  # the longest rows are in the last slots: the tail moves them into the first ones


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}], ids=["plain", "top_p"])
def test_a_long_tail_goes_on_in_smaller_batches_and_samples_as_in_the_whole_one(tiny_model_dirs, monkeypatch, sampling):
    """10 rows in a bucket of 16: at the look after 16 forwards 6 rows are left (two of them in slots 8 and 9, moved
    into free first slots), a batch of 8 goes on, then one of 2 for the last two rows after 32, and one of 1 after
    48, when a stop string has ended one of them. Tokens, finish reasons, kept sets and log-probs are those of the
    whole batch; a second call reuses the smaller batches."""
    monkeypatch.setattr(decode_run, "num_slots", lambda n, device: row_bucket(n))  # padding rows as on CUDA
    monkeypatch.setattr(decode_run, "SHRINK_MIN_FORWARDS", 1)
    engine = EmbeddedEngine(tiny_model_dirs["qwen2"], seed=0)
    params = [
        {"max_new_tokens": n, "n": 2, "sampling_seed": 11 + k, "ignore_eos": True, **sampling}
        for k, n in enumerate(TAIL)
    ]
    monkeypatch.setattr(decode_run, "SHRINK_MIN_ROWS", 10**6)  # the whole batch to the end
    longest = engine.generate(PROMPTS, params)[8]["output_ids"]
    decode = engine.tokenizer.decode
    head = decode(longest[:40])  # a stop string that the 40th token completes, after the second shrink
    params[4]["stop"] = next(head[-n:] for n in range(1, len(head) + 1) if head[-n:] not in decode(longest[:39]))
    want = engine.generate(PROMPTS, params)
    assert want[8]["finish_reason"] == {"type": "stop", "matched": params[4]["stop"]}
    assert len(want[8]["output_ids"]) == 40

    monkeypatch.setattr(decode_run, "SHRINK_MIN_ROWS", 1)
    rows = _rows_per_forward(monkeypatch)
    got = engine.generate(PROMPTS, params)
    assert sorted(set(rows), reverse=True) == [16, 8, 2, 1] and rows[-1] == 1
    assert [rows.index(n) for n in (8, 2, 1)] == [16, 32, 48]  # shrunk at the looks after 16, 32 and 48 forwards
    _assert_same(got, want)
    heads = engine._warm.last.heads
    assert sorted(heads) == [1, 2, 8]
    made = dict(heads)
    _assert_same(engine.generate(PROMPTS, params), want)
    assert engine._warm.last.heads == made  # the same smaller batches, their steps kept


def test_a_tail_that_ends_soon_or_is_not_small_enough_keeps_its_batch(tiny_model_dirs, monkeypatch):
    monkeypatch.setattr(decode_run, "num_slots", lambda n, device: row_bucket(n))
    engine = EmbeddedEngine(tiny_model_dirs["qwen3"], seed=0)
    lengths = [*TAIL[:-1], 90]
    params = [{"max_new_tokens": n, "n": 2, "temperature": 0, "ignore_eos": True} for n in lengths]
    rows = _rows_per_forward(monkeypatch)
    engine.generate(PROMPTS, params)  # the defaults: never under 16 rows
    assert set(rows) == {16}
    rows.clear()
    monkeypatch.setattr(decode_run, "SHRINK_MIN_ROWS", 1)
    engine.generate(PROMPTS, params)  # 74 forwards left after 16: shrunk; 58 after 32: not worth it (64)
    assert sorted(set(rows), reverse=True) == [16, 8]
