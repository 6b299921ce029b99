"""The typed batch a rank trains on: rank 0 plans every rank's share of a rollout and scatters it.

    rank 0:  samples (prompt-major, whole groups) -> group scores, tied groups dropped (rlrun.algo)
             -> ``train.updates_per_rollout`` updates of whole groups -> per update: each sample's training
             samples (its parts, or ``rollout.sample_to_train``'s; rlrun/rollout/train_samples.py) with its
             group score -> packed micro-batches,
             balanced over DP ranks, and the update's global loss-token and loss-sample counts
    every rank:  its ``TrainBatch`` (TP / PP peers of a DP rank receive the same micro-batches)

The global counts normalise each update's loss (``rlrun.algo.aggregate.StepCounts``); they are counted once,
here, from the micro-batches rank 0 built, so no rank needs a collective to learn them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from rlrun.algo.advantages import score_groups
from rlrun.config.schema import RunConfig
from rlrun.data.batch import MicroBatch, schedule_micro_batches
from rlrun.data.sample import Sample
from rlrun.rollout.driver import group_samples
from rlrun.rollout.train_samples import SampleToTrain, train_samples

T = TypeVar("T")


@dataclass
class Update:
    """One optimizer update's share of a rollout on this rank.

    Invariant: ``num_global_tokens`` and ``num_global_samples`` count every DP rank's micro-batches of this
    update (each DP replica once), so they are equal on every rank."""

    micro_batches: list[MicroBatch]
    num_global_tokens: int
    """Loss tokens of the update over all DP ranks: the token-mean loss divides by it."""
    num_global_samples: int
    """Samples with at least one loss token over all DP ranks (``MicroBatch.num_loss_samples`` summed)."""


@dataclass
class TrainBatch:
    """This rank's share of one rollout step: its updates, in the order they train (empty: nothing to train,
    when every group was tied or ``debug.rollout_only`` is on). The micro-batches' ``advantages`` hold group
    scores until :meth:`rlrun.trainer.actor.Actor.prepare` turns them into per-token advantages."""

    updates: list[Update]

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """Every micro-batch of every update, in order (log-probs and advantages are computed over all)."""
        return [mb for update in self.updates for mb in update.micro_batches]


@dataclass(frozen=True)
class BatchPlanner:
    """Rank 0's plan of a step's training work: what it needs to know about the run's ranks."""

    cfg: RunConfig
    dp_rank_of: list[int]
    """The DP rank of every global rank (index: global rank)."""
    dp_size: int
    pad_token_id: int
    sample_to_train: SampleToTrain | None = None
    """``rollout.sample_to_train``; None: each sample trains as itself (or as its parts)."""

    def plan(self, samples: list[Sample], metrics: dict[str, float]) -> list[TrainBatch]:
        """One ``TrainBatch`` per global rank; adds the rollout's reward and length metrics to ``metrics``."""
        cfg = self.cfg
        groups = group_samples(samples, cfg.rollout.samples_per_prompt)
        rewards = torch.tensor([[s.reward for s in g] for g in groups], dtype=torch.float32)
        scored = score_groups(cfg.algorithm, rewards)
        metrics.update(rollout_metrics(samples, scored.keep))
        kept = [
            (s, float(a))
            for g, score, k in zip(groups, scored.scores, scored.keep, strict=False)
            if k
            for s, a in zip(g, score, strict=False)
        ]
        per_update = []  # [update] -> (micro-batches per DP rank, global tokens, global samples)
        num_train_samples = 0
        for trajectories in split_into_updates(kept, cfg.rollout.samples_per_prompt, cfg.train.updates_per_rollout):
            part = [(t, a) for s, a in trajectories for t in train_samples(s, self.sample_to_train)]
            num_train_samples += len(part)
            if not part:  # the hook dropped every sample of this update
                continue
            per_dp = schedule_micro_batches(
                [s for s, _ in part],
                [a for _, a in part],
                dp_size=self.dp_size,
                max_tokens=cfg.train.max_tokens_per_micro_batch,
                pad_token_id=self.pad_token_id,
                one_sample_per_micro_batch=cfg.parallel.cp > 1,  # context parallelism cuts unpacked rows
            )
            num_samples = sum(mb.num_loss_samples for mbs in per_dp for mb in mbs)
            per_update.append((per_dp, sum(s.num_loss_tokens for s, _ in part), num_samples))
        metrics["rollout/train_samples"] = num_train_samples
        return [
            TrainBatch([Update(per_dp[dp_rank], tokens, num_samples) for per_dp, tokens, num_samples in per_update])
            for dp_rank in self.dp_rank_of
        ]


def split_into_updates(kept: list[T], group_size: int, num_updates: int) -> list[list[T]]:
    """The kept samples (prompt-major, whole groups) in ``min(num_updates, groups)`` consecutive parts of
    whole groups, as equal in group count as possible (the first parts get the extra groups); none when
    nothing is kept."""
    num_groups = len(kept) // group_size
    num_parts = min(num_updates, num_groups)
    sizes = [num_groups // num_parts + (k < num_groups % num_parts) for k in range(num_parts)]
    parts, start = [], 0
    for size in sizes:
        parts.append(kept[start * group_size : (start + size) * group_size])
        start += size
    return parts


def rollout_metrics(samples: list[Sample], kept_groups: torch.Tensor) -> dict[str, float]:
    lengths = [len(s.response_ids) for s in samples]
    return {
        "rollout/reward_mean": sum(s.reward for s in samples) / len(samples),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/tied_group_frac": 1.0 - kept_groups.float().mean().item(),
    }
