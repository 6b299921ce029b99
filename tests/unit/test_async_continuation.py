"""``rollout.continue_after_tokens``: which weights sample which tokens of a rollout generated ahead, against
the rule written out by hand (step m: each response's first N tokens under the weights trained through step
m-K-1, the rest of a longer response under those trained through step m-K), over the real schedule
(``RolloutAhead``) and the real segmented generation and continue path, with a fake engine and trainer."""

from __future__ import annotations

import dataclasses
import io
import re
import threading
import time

import pytest
import torch

from minimal_config import rollout_config, run_config
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.ahead import Published, RolloutAhead
from rlrun.rollout.driver import generate_samples
from rlrun.rollout.segments import SegmentedGeneration

MAX_NEW_TOKENS, BOUNDARY = 8, 4
LENGTHS = {0: [2, 8], 1: [4, 7]}
"""Per prompt, per sample: the response's length (two fit in segment 0, two do not)."""


class VersionedEngine:
    """Writes token ``100 + 10 * prompt + k`` for sample k of a prompt, with log-prob ``-version``: each token's
    rollout log-prob says which weights drew it. A continuation (prompt + tokens) names its sample by its tokens."""

    def __init__(self) -> None:
        self.version = 0

    def generate(self, inputs, params, return_logprob=True, rids=None):
        per_input = params if isinstance(params, list) else [params] * len(inputs)
        out = []
        for ids, p in zip(inputs, per_input, strict=True):
            prompt, done = ids[0], len(ids) - 1
            for k in range(p["n"]) if done == 0 else [ids[-1] - 100 - 10 * prompt]:
                left = LENGTHS[prompt][k] - done
                num = min(left, p["max_new_tokens"])
                out.append(
                    {
                        "output_ids": [100 + 10 * prompt + k] * num,
                        "output_logprobs": [-float(self.version)] * num,
                        "finish_reason": {"type": "stop" if num == left else "length"},
                        "weight_version": str(self.version),
                    }
                )
        return out


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


ROLLOUT = rollout_config(samples_per_prompt=2, max_new_tokens=MAX_NEW_TOKENS, continue_after_tokens=BOUNDARY)
PROMPTS = [Prompt(i, [i], f"p{i}") for i in LENGTHS]


def schedule(
    engine: VersionedEngine, max_staleness: int, end_step: int, prompts=PROMPTS, continued: bool = True
) -> RolloutAhead[list[Sample]]:
    """The real schedule whose rollouts generate ``prompts`` on ``engine`` in segments (or, not ``continued``,
    wholly under one version); a push sets the engine's version."""

    def collect(step: int) -> list[Sample]:
        if not continued:
            return generate_samples(engine, prompts, ROLLOUT, step, Tokenizer())
        segments.start(step)
        return segments.generate(engine, prompts, ROLLOUT, step, Tokenizer())

    def push(published: Published) -> None:
        engine.version = published.version

    ahead: RolloutAhead[list[Sample]] = RolloutAhead(collect, push, max_staleness, 0, end_step=end_step)
    segments = SegmentedGeneration(ahead.enter_segment)
    return ahead


def run(max_staleness: int, num_steps: int, continued: bool = True) -> list[list[Sample]]:
    """A fake trainer over the real schedule; each step's samples. Step 2 trains slowly, so the rollout that
    continues under its weights has to wait for them."""
    ahead = schedule(VersionedEngine(), max_staleness, num_steps, continued=continued)
    batches = []
    for step in range(num_steps):
        ahead.launch_until(step)
        batches.append(ahead.take(step))
        time.sleep(0.2 if step == 2 else 0.0)
        ahead.publish(step, Published(step + 1, None))
    ahead.close()
    return batches


def token_versions(sample: Sample) -> list[int]:
    return [round(-lp) for lp in sample.rollout_logprobs]


@pytest.mark.parametrize("k", [2, 3])
def test_long_samples_continue_under_the_update_published_while_the_rollout_runs(k):
    for step, samples in enumerate(run(k, 7)):
        old, new = max(0, step - k), max(0, step - k + 1)  # version v: the weights trained through step v - 1
        assert len(samples) == 4
        for sample in samples:
            length = LENGTHS[sample.group_index][sample.response_ids[0] % 10]
            want = [old] * min(length, BOUNDARY) + [new] * (length - BOUNDARY)
            assert token_versions(sample) == want, (step, sample.response_ids)
            assert sample.weight_version == str(want[-1])
            spans = sample.weight_spans or [(sample.weight_version, length)]
            assert [v for v, n in spans for _ in range(n)] == [str(v) for v in want]  # spans say the same
            assert sample.finish_reason == "stop"  # nothing left cut at the boundary


def test_without_continuation_every_token_is_k_versions_old():
    """The same schedule with the continuation skipped: the rule above fails (the test can fail)."""
    for step, samples in enumerate(run(2, 5, continued=False)):
        for sample in samples:
            assert set(token_versions(sample)) == {max(0, step - 2)}
            assert sample.weight_spans is None


@pytest.mark.parametrize("k", [2, 3])
def test_a_checkpoint_drain_never_waits_on_an_untrained_step(k):
    """After step t publishes (a checkpoint's moment), every launched rollout (up to t + K) can finish."""
    ahead = schedule(VersionedEngine(), k, 20)
    for step in range(3):
        ahead.launch_until(step)
        ahead.take(step)
        ahead.publish(step, Published(step + 1, None))
    drained: dict = {}
    thread = threading.Thread(target=lambda: drained.update(ahead.drain()))
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "drain waited on a step not yet trained"
    assert sorted(drained) == list(range(3, 3 + k))
    ahead.close()


def test_close_ends_a_rollout_waiting_for_weights():
    """Step 2's rollout (K = 2) waits for step 0 to end; closing the schedule ends the wait with an error."""
    ahead = schedule(VersionedEngine(), 2, 5, prompts=PROMPTS[1:])
    ahead.launch_until(0)
    ahead.take(0), ahead.take(1)
    ahead.close()
    with pytest.raises(RuntimeError, match="step 2's rollout stopped waiting for step 0's weights"):
        ahead.take(2)


def test_spans_survive_the_checkpoint_carry():
    """A continued sample through the checkpoint's plain data (``torch.save``, ``weights_only`` load) and back."""
    sample = run(2, 3)[2][1]
    assert sample.weight_spans == [("0", 4), ("1", 4)]
    buffer = io.BytesIO()
    torch.save([dataclasses.asdict(sample)], buffer)
    buffer.seek(0)
    (row,) = torch.load(buffer, weights_only=True)
    assert Sample.from_dict(row) == sample


@pytest.mark.parametrize(
    ("rollout", "key"),
    [
        ({"max_staleness": 1}, "rollout.max_staleness >= 2"),
        ({"max_staleness": 0}, "rollout.max_staleness >= 2"),
        ({"max_staleness": 2, "max_new_tokens": 4}, "rollout.max_new_tokens (4)"),
        ({"max_staleness": 2, "rollout_fn": "examples/hooks/rollout_fn.py:mixed_budgets"}, "rollout.rollout_fn"),
    ],
)
def test_config_refuses_a_continuation_it_cannot_serve(rollout, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        run_config({"rollout": {**rollout, "continue_after_tokens": 4}})


def test_config_takes_continuation_with_k_2():
    cfg = run_config({"rollout": {"max_staleness": 2, "continue_after_tokens": 4}})
    assert cfg.rollout.continue_after_tokens == 4
