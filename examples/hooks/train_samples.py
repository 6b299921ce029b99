"""A sample-to-train-data hook (``rollout.sample_to_train``): one training sample per model turn.

    rollout:
      generate_fn: examples/calculator_tool/agent.py:generate
      sample_to_train: examples/hooks/train_samples.py:per_turn

A multi-turn sample (model turns interleaved with tool turns, ``loss_mask`` 1 / 0) becomes one training
sample per model turn, whose prompt is everything before that turn (the original prompt, earlier turns and
tool results) and whose response is the turn alone. Every one trains with the trajectory's group score, so
the advantage is the same as training the whole sequence; what changes is the loss normalisation (a
sample-mean loss weighs turns equally) and the sequences the trainer packs. ``prompt_text`` stays the
row's. Interface: rlrun/rollout/train_samples.py.
"""

from __future__ import annotations

import dataclasses


def model_turns(loss_mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of every maximal run of 1s."""
    turns, start = [], None
    for i, bit in enumerate([*loss_mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            turns.append((start, i))
            start = None
    return turns


def per_turn(sample) -> list:
    out = []
    for part in sample.parts or [sample]:
        mask = part.loss_mask or [1] * len(part.response_ids)
        for start, end in model_turns(mask):
            out.append(
                dataclasses.replace(
                    part,
                    prompt=dataclasses.replace(
                        part.prompt, prompt_ids=part.prompt.prompt_ids + part.response_ids[:start]
                    ),
                    response_ids=part.response_ids[start:end],
                    rollout_logprobs=part.rollout_logprobs[start:end],
                    loss_mask=None,
                    teacher_logprobs=part.teacher_logprobs[start:end] if part.teacher_logprobs else None,
                    routed_experts=None,
                    kept_ids=None,
                    parts=None,
                )
            )
    return out
