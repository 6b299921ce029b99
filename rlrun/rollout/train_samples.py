"""Rollout samples -> training samples, on rank 0 after group scores (slime's converting samples to
training data, ``--custom-convert-samples-to-train-data-path``)::

    def fn(sample: Sample) -> list[Sample]     # rollout.sample_to_train: the samples this one trains as

A rollout sample is one trajectory of a group: the reward, the dynamic filter and the group statistics
(GRPO's mean and std, the tied-group drop) see it once. What it trains as is decided here: by default the
sample itself, or its ``parts`` when a ``generate_fn`` returned several samples for one trajectory. A hook
may split, trim, re-mask or drop (return ``[]``) samples. Every returned sample trains with the group score
(advantage) of the trajectory it came from: a trajectory of three parts puts its one advantage on the loss
tokens of all three, and a token-mean loss counts each part's tokens, a sample-mean loss each part. PPO's
critic and GAE see each part as its own sequence, with the trajectory's reward at the part's end.
Example: examples/hooks/train_samples.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlrun.data.sample import Sample
from rlrun.runtime.hooks import load_hook

SIGNATURE = "fn(sample: Sample) -> list[Sample]"


@dataclass(frozen=True)
class SampleToTrain:
    """``rollout.sample_to_train``'s function and the spec it was loaded from (named in its errors)."""

    fn: Callable[[Sample], list[Sample]]
    spec: str

    @classmethod
    def load(cls, spec: str) -> SampleToTrain:
        return cls(load_hook(spec, "rollout.sample_to_train", SIGNATURE, num_args=1), spec)


def default_train_samples(sample: Sample) -> list[Sample]:
    """A trajectory's parts, or the sample itself."""
    return list(sample.parts) if sample.parts else [sample]


def train_samples(sample: Sample, hook: SampleToTrain | None = None) -> list[Sample]:
    """What ``sample`` trains as (``hook``'s samples when set, else :func:`default_train_samples`), checked
    against :class:`Sample`'s invariants so a hook's mistake names the hook and the prompt."""
    out = default_train_samples(sample) if hook is None else hook.fn(sample)
    who = "a generate_fn's parts" if hook is None else f"rollout.sample_to_train ('{hook.spec}')"
    if not isinstance(out, list) or not all(isinstance(s, Sample) for s in out):
        raise TypeError(
            f"{who} returned {type(out).__name__} for prompt {sample.group_index}; it must return a list of Sample "
            f"(signature {SIGNATURE}) because each one becomes a training sample; fix the hook"
        )
    for s in out:
        lengths = {"rollout_logprobs": len(s.rollout_logprobs)}
        lengths |= {"loss_mask": len(s.loss_mask)} if s.loss_mask is not None else {}
        lengths |= {"teacher_logprobs": len(s.teacher_logprobs)} if s.teacher_logprobs is not None else {}
        wrong = {k: n for k, n in lengths.items() if n != len(s.response_ids)}
        if wrong:
            raise ValueError(
                f"{who} returned a sample of prompt {sample.group_index} with {wrong} entries for "
                f"{len(s.response_ids)} response tokens; each must have one per response token because the trainer "
                "aligns them with the tokens; cut them together (or set loss_mask / teacher_logprobs to None)"
            )
    return out
