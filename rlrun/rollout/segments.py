"""A rollout generated ahead that continues across a weight update (``rollout.continue_after_tokens`` N).

Step m's rollout, generated up to K steps ahead (rlrun/rollout/ahead.py), runs in two segments of the response
token budget::

    segment 0: every sample, tokens [0, N), under the weights trained through step m-K-1
    ---------- wait until the trainer is through step m-K; push its weights (version m-K+1)
    segment 1: the samples cut at N continue from prompt + their tokens, under those weights

Responses of N tokens or fewer finish under the older weights; the rest of a longer one under the fresher. A
continued sample keeps each token's version in ``Sample.weight_spans`` and its per-token rollout log-probs, so
the mismatch corrections (``algorithm.tis``) apply token by token. The boundary is a token count and the weights of each
segment are fixed by the step, so which weights sample which token never depends on timing.

Why two segments and not K: segment 1's weights are the update published while the rollout runs (step m-K
trains while step m generates). Weights of a later step would make the rollout wait for steps trained after
it was launched, so it could no longer run K steps ahead, and a checkpoint after step m-K could not finish
it: its drain would wait on a step that never trains before the save.

Later sampling rounds of the same step (a dynamic filter drawing more prompts) generate wholly under the
newer weights: the engine's weights only move forward.
"""

from __future__ import annotations

from typing import Callable

from rlrun.config.schema import RolloutConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.driver import generate_samples
from rlrun.rollout.streaming import continue_unfinished


class SegmentedGeneration:
    """One rank's generation on the rollout thread, in the module docstring's two segments.

    ``enter_segment(step, segment)`` loads that segment's weights into the engine, waiting for them to be
    published (:meth:`rlrun.rollout.ahead.RolloutAhead.enter_segment`); call :meth:`start` before each step's
    rollout (segment 0's weights are loaded by then)."""

    def __init__(self, enter_segment: Callable[[int, int], None]) -> None:
        self.enter_segment = enter_segment
        self.step = -1
        """The step whose rollout runs."""
        self.segment = 0
        """The segment whose weights the engine holds."""

    def start(self, step: int) -> None:
        self.step, self.segment = step, 0

    def generate(self, engine, prompts: list[Prompt], r: RolloutConfig, seed: int, tokenizer) -> list[Sample]:
        """``samples_per_prompt`` responses per prompt (:func:`rlrun.rollout.driver.generate_samples`), those
        longer than segment 0 continued under segment 1's weights. Every rank calls it once per sampling
        round, with or without prompts, so every rank moves to segment 1 at the same round."""
        boundary = r.continue_after_tokens
        assert boundary is not None, "segmented generation without rollout.continue_after_tokens"
        if self.segment == 1:
            return generate_samples(engine, prompts, r, seed, tokenizer)
        head = generate_samples(engine, prompts, r.model_copy(update={"max_new_tokens": boundary}), seed, tokenizer)
        for sample in head:
            if sample.finish_reason == "length" and len(sample.response_ids) == boundary < r.max_new_tokens:
                sample.finish_reason = "abort"  # cut at the boundary, not finished: continue_unfinished's mark
        self.segment = 1
        self.enter_segment(self.step, 1)
        return continue_unfinished(engine, head, r, seed, tokenizer, rid=f"step{self.step}")
