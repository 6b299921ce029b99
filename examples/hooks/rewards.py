"""A reward post-process hook (``rollout.reward_post_process``): a length penalty relative to the group.

    rollout:
      reward_post_process: examples/hooks/rewards.py:length_penalty

Each sample loses ``PENALTY`` times how far its response is above its group's shortest, as a fraction of
the group's length range, so among equally right answers the shorter ones get the larger advantage.
Interface: rlrun/rollout/rewards/post_process.py.
"""

from __future__ import annotations

from itertools import groupby

PENALTY = 0.1


def length_penalty(samples) -> list[float]:
    out = []
    for _, group in groupby(samples, key=lambda s: s.group_index):  # prompt-major: groups are contiguous
        group = list(group)
        lengths = [s.num_loss_tokens for s in group]
        low, span = min(lengths), max(lengths) - min(lengths)
        out += [s.reward - (PENALTY * (n - low) / span if span else 0.0) for s, n in zip(group, lengths, strict=True)]
    return out
