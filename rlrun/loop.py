"""Moved to :mod:`rlrun.trainer.loop`; this name keeps older imports working, with the pre-trainer
``train(parts, updates, step)`` over hand-made two-field ``Update`` s (tests drive it by hand)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrun.data.batch import MicroBatch
from rlrun.trainer import batch as trainer_batch
from rlrun.trainer.actor import Actor, TrainerHooks, dp_sum
from rlrun.trainer.batch import TrainBatch, rollout_metrics, split_into_updates
from rlrun.trainer.loop import Components, RunState, run, setup, sync_weights, train_one_step

__all__ = [
    "Components",
    "RunState",
    "Update",
    "rollout_metrics",
    "run",
    "setup",
    "split_into_updates",
    "sync_weights",
    "train",
    "train_one_step",
]


@dataclass
class Update:
    """An update without its global sample count (:func:`train` sums it over DP)."""

    micro_batches: list[MicroBatch]
    num_global_tokens: int


def train(parts, updates: list[Update], step: int) -> dict[str, float]:
    """``Actor.train`` over ``updates``, the actor assembled from ``parts`` (the pre-trainer ``Components``'
    cfg, parallel, model, optimizer, scheduler, roles and critic); each update's global sample
    count is summed over DP here (in the loop, rank 0 counts it when it plans the batch)."""
    actor = Actor(
        parts.cfg,
        parts.parallel,
        parts.model,
        parts.optimizer,
        parts.scheduler,
        parts.roles,
        parts.critic,
        TrainerHooks.load(parts.cfg.algorithm),
    )
    batch = TrainBatch(
        [
            trainer_batch.Update(u.micro_batches, u.num_global_tokens, _global_samples(actor, u.micro_batches))
            for u in updates
        ]
    )
    return actor.train(batch, step)


def _global_samples(actor: Actor, micro_batches: list[MicroBatch]) -> int:
    local = torch.tensor(sum(mb.num_loss_samples for mb in micro_batches))
    return int(dp_sum(actor.parallel, local).item())
