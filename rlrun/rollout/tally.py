"""Rank 0's bookkeeping over one step's sampling rounds (rlrun/rollout/collect.py): the groups kept by the dynamic
filter, what was drawn and generated, and the ``rollout/*`` metrics of the batch it hands to training."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rlrun.data.sample import Sample
from rlrun.rollout.filters import GroupFilter, apply_filter
from rlrun.rollout.rewards.breakdown import reward_breakdown

logger = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """What rank 0 trains on this step: whole groups, prompt-major, plus how they were obtained."""

    samples: list[Sample]
    metrics: dict[str, float]


@dataclass
class RoundTally:
    """Rank 0's bookkeeping over one step's sampling rounds."""

    target: int
    source_key: str = "source"
    """``data.source_key``: the metadata key of a row's data source, for the per-source reward means."""
    kept: list[list[Sample]] = field(default_factory=list)
    last_round: list[list[Sample]] = field(default_factory=list)
    generated: list[Sample] = field(default_factory=list)
    rounds: int = 0
    prompts_drawn: int = 0
    groups_generated: int = 0

    engine_lost: bool = False
    """A rank's engine was lost this round (``EngineLost``): no more rounds, the loop restarts it and redoes
    the step."""
    aborted: list[list[Sample]] = field(default_factory=list)
    """Streaming rounds: groups still generating when the batch filled, as the abort returned them."""
    abort_wait_s: float = 0.0

    def add_round(self, groups: list[list[Sample]], keep: GroupFilter | None) -> None:
        self.rounds += 1
        self.last_round = []
        self.add_groups(groups, keep)

    def add_groups(self, groups: list[list[Sample]], keep: GroupFilter | None) -> None:
        """Finished, scored groups of the current round (streaming rounds add them as they come)."""
        self.last_round += groups
        self.generated += [s for g in groups for s in g]
        self.groups_generated += len(groups)
        self.kept += groups if keep is None else apply_filter(keep, groups)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.target

    def batch(self) -> RolloutBatch:
        exhausted = len(self.kept) < self.target
        groups = self.kept[: self.target] if self.kept else self.last_round
        if exhausted:
            logger.warning(
                "dynamic filter kept %d of %d groups after %d rounds (rollout.max_sampling_rounds); training on %s",
                len(self.kept),
                self.target,
                self.rounds,
                "those" if self.kept else "the last round's groups unfiltered",
            )
        metrics = {
            "rollout/sampling_rounds": self.rounds,
            "rollout/prompts_drawn": self.prompts_drawn,
            "rollout/filter_drop_frac": 1.0 - len(self.kept) / max(self.groups_generated, 1),
            "rollout/surplus_groups": max(len(self.kept) - self.target, 0),
            "rollout/filter_exhausted": float(exhausted),
            "rollout/raw_reward_mean": sum(s.reward for s in self.generated) / max(len(self.generated), 1),
            "rollout/reward_errors": sum(s.reward_error is not None for s in self.generated),
            **reward_breakdown(self.generated, self.source_key, "rollout"),
        }
        return RolloutBatch([s for g in groups for s in g], metrics)
