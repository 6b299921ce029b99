"""The embedded backend merges generate calls that arrive together into one decode batch, hands each call
its results as soon as its own rows are done, and samples exactly what separate calls sample."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlrun.engine.embedded.backend import EmbeddedBackend
from rlrun.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # loads a model

PROMPTS = [[72, 101, 108], [257, 9, 44, 5], [1, 2, 3]]


def params(max_new_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "n": 2, "ignore_eos": True, "sampling_seed": 3})
    ]


async def timed(backend, prompt, sp, rid):
    results = await backend.generate([prompt], sp, True, [rid])
    return time.perf_counter(), results


def test_merged_calls_return_as_their_rows_finish(tiny_model_dirs):
    backend = EmbeddedBackend(str(tiny_model_dirs["qwen2"]), seed=0, dtype="float32", device="cpu")

    async def together():
        calls = [timed(backend, PROMPTS[0], params(300), "long"), timed(backend, PROMPTS[1], params(4), "short")]
        calls.append(timed(backend, PROMPTS[2], params(20), "mid"))
        return await asyncio.gather(*calls)

    async def alone(prompt, sp, rid):
        return await backend.generate([prompt], sp, True, [rid])

    (t_long, long), (t_short, short), (t_mid, mid) = asyncio.run(together())
    assert t_short < t_mid < t_long  # each returned when its own rows were done, not with the batch
    assert [len(r["output_ids"]) for r in long + short + mid] == [300, 300, 4, 4, 20, 20]
    assert [r["rid"] for r in long + short] == ["long-0", "long-1", "short-0", "short-1"]
    for prompt, sp, rid, merged in ((PROMPTS[1], params(4), "short", short), (PROMPTS[2], params(20), "mid", mid)):
        separate = asyncio.run(alone(prompt, sp, rid))
        assert [r["output_ids"] for r in separate] == [r["output_ids"] for r in merged]
        for a, b in zip(separate, merged, strict=True):
            assert a["output_logprobs"] == pytest.approx(b["output_logprobs"], abs=1e-5)
    backend.shutdown()


def test_abort_of_one_merged_call_leaves_the_others(tiny_model_dirs):
    backend = EmbeddedBackend(str(tiny_model_dirs["qwen2"]), seed=0, dtype="float32", device="cpu")

    async def run():
        long = asyncio.ensure_future(backend.generate([PROMPTS[0]], params(400), True, ["g0"]))
        other = asyncio.ensure_future(backend.generate([PROMPTS[1]], params(40), True, ["g1"]))
        # the abort comes once the merged batch has decoded 20 steps (not after a fixed time: on a fast host the
        # long call could finish first), while both other calls are still running
        await backend.generate([PROMPTS[2]], params(20), True, ["g2"])
        start = time.perf_counter()
        await backend.abort("g0", False)
        aborted = await long
        return time.perf_counter() - start, aborted, await other

    wait_s, aborted, other = asyncio.run(run())
    assert all(r["finish_reason"]["type"] == "abort" and 0 < len(r["output_ids"]) < 400 for r in aborted)
    assert wait_s < 1.0  # returned within a few decode steps of the abort
    assert [len(r["output_ids"]) for r in other] == [40, 40]
    backend.shutdown()
