"""One step's rollout across ranks: draw prompts, generate and score on every rank, filter groups on
rank 0, and draw again until the batch is full.

    round r:  rank 0 draws ``prompts_per_round`` prompts ──scatter whole groups──> every rank
              every rank: generate (engine or generate_fn) + score ──gather──> rank 0
                          (engine.tp > 1: each group's leader generates its group's prompts)
              rank 0: dynamic filter keeps whole groups; enough kept or ``max_sampling_rounds``? stop
    (the stop is itself a scatter of ``None`` to every rank, so all ranks leave the loop together)

Only rank 0 holds the sampler, so its position (checkpointed) counts every prompt drawn, including
the ones whose groups the filter dropped: a resumed run draws what the original would have drawn.

Rank 0 logs the rounds, draws and filter outcome as ``rollout/*`` (docs/metrics.md); failing rewards
are also logged with their message.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlrun.config.schema import RolloutConfig, RunConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.data.transfer import gather_to_rank0, scatter_from_rank0
from rlrun.rollout.debug_data import load_rollout, save_rollout
from rlrun.rollout.driver import generate_samples, group_samples, split_groups
from rlrun.rollout.evaluate import Evaluator
from rlrun.rollout.filters import GroupFilter, apply_filter, load_filter
from rlrun.rollout.multiturn import load_generate_fn
from rlrun.rollout.rewards import load_reward_fn, score_samples

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
    kept: list[list[Sample]] = field(default_factory=list)
    last_round: list[list[Sample]] = field(default_factory=list)
    generated: list[Sample] = field(default_factory=list)
    rounds: int = 0
    prompts_drawn: int = 0
    groups_generated: int = 0

    def add_round(self, groups: list[list[Sample]], keep: GroupFilter | None) -> None:
        self.rounds += 1
        self.last_round = groups
        self.generated += [s for g in groups for s in g]
        self.groups_generated += len(groups)
        self.kept += groups if keep is None else apply_filter(keep, groups)

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
        }
        return RolloutBatch([s for g in groups for s in g], metrics)


@dataclass(frozen=True)
class RolloutHooks:
    """The rollout's user-replaceable functions, resolved from ``rollout.*`` specs."""

    reward_fn: Callable
    generate_fn: Callable | None
    group_filter: GroupFilter | None

    @classmethod
    def load(cls, r: RolloutConfig) -> RolloutHooks:
        """Import every hook the config names; raises ``RewardSpecError`` / ``HookSpecError`` naming the key
        (cheap: call it when the config is loaded, so a bad path fails before any model loads)."""
        return cls(
            reward_fn=load_reward_fn(r.reward, r.remote_reward),
            generate_fn=load_generate_fn(r.generate_fn) if r.generate_fn else None,
            group_filter=load_filter(r.dynamic_filter) if r.dynamic_filter else None,
        )


@dataclass
class RolloutRuntime:
    """Everything one rank needs to produce rollouts, resolved once at setup (hooks included)."""

    cfg: RunConfig
    parallel: Any
    engine: Any  # this rank's EngineClient; None on a rank whose engine group leader generates for it
    tokenizer: Any
    sampler: Any | None  # rank 0 only
    hooks: RolloutHooks
    max_context_tokens: int | None = None
    evaluator: Evaluator | None = None
    group: Any = None
    """rlrun.engine.group.EngineGroup when ``engine.tp > 1``: its leader generates the whole group's prompts."""

    @classmethod
    def build(cls, cfg: RunConfig, parallel, engine, tokenizer, sampler, group=None) -> RolloutRuntime:
        runtime = cls(
            cfg=cfg,
            parallel=parallel,
            engine=engine,
            tokenizer=tokenizer,
            sampler=sampler,
            hooks=RolloutHooks.load(cfg.rollout),
            group=group,
        )
        if runtime.hooks.generate_fn is not None:
            runtime.max_context_tokens = cfg.rollout.max_context_tokens or model_context_tokens(cfg.model.path)
        if cfg.eval.interval > 0:
            runtime.evaluator = Evaluator(runtime, tokenizer)
        return runtime

    def evaluate_if_due(self, step: int) -> dict[str, float]:
        """Eval metrics (rank 0) when ``eval.interval`` says this step evaluates, else ``{}``."""
        return self.evaluator.run(step) if self.evaluator is not None and self.evaluator.due(step) else {}

    def generate_and_score(
        self, prompts: list[Prompt], seed: int, rollout_cfg: RolloutConfig | None = None
    ) -> list[Sample]:
        """This rank's share: generate ``samples_per_prompt`` responses per prompt and score them. In an
        engine group every rank passes its share and gets its own samples back, but the leader generates
        and scores the whole group's prompts in one call (with its ``seed``)."""
        r = rollout_cfg or self.cfg.rollout
        if self.group is None:
            return self._generate_and_score_here(prompts, seed, r)
        return self.group.run_on_leader(
            prompts, lambda group_prompts: self._generate_and_score_here(group_prompts, seed, r), r.samples_per_prompt
        )

    def _generate_and_score_here(self, prompts: list[Prompt], seed: int, r: RolloutConfig) -> list[Sample]:
        samples = generate_samples(
            self.engine, prompts, r, seed, self.tokenizer, self.hooks.generate_fn, self.max_context_tokens
        )
        score_samples(
            samples,
            self.hooks.reward_fn,
            group_size=r.samples_per_prompt if r.reward_per_group else None,
            concurrency=r.reward_concurrency,
        )
        return samples

    def collect(self, step: int) -> RolloutBatch | None:
        """Sampling rounds until the batch is full; rank 0 gets the batch, the other ranks None.

        With ``debug.load_rollout_data`` rank 0 reads the step's saved batch instead (no engine
        call); with ``debug.save_rollout_data`` it writes the batch it returns.
        """
        debug = self.cfg.debug
        if debug.load_rollout_data:
            samples = load_rollout(debug.load_rollout_data, step) if self.parallel.is_rank0 else None
            return RolloutBatch(samples, {"rollout/loaded_from_disk": 1.0}) if samples is not None else None
        batch = self._sample_rounds(step)
        if batch is not None and debug.save_rollout_data:
            save_rollout(self.debug_dir, step, batch.samples)
        return batch

    @property
    def debug_dir(self) -> Path:
        return Path(self.cfg.logging.run_dir) / "debug"

    def _sample_rounds(self, step: int) -> RolloutBatch | None:
        r, parallel = self.cfg.rollout, self.parallel
        tally = RoundTally(target=r.prompts_per_step) if parallel.is_rank0 else None
        for round_index in itertools.count():
            plan = self._plan_round(tally) if tally is not None else None
            prompts = scatter_from_rank0(plan, parallel.cpu_group)
            if prompts is None:
                break
            seed = self.cfg.train.seed * 1_000_003 + step * 1009 + parallel.rank + 104_729 * round_index
            gathered = gather_to_rank0(self.generate_and_score(prompts, seed), parallel.cpu_group)
            if tally is not None:
                groups = group_samples([s for rank_samples in gathered for s in rank_samples], r.samples_per_prompt)
                tally.add_round(groups, self.hooks.group_filter)
        return tally.batch() if tally is not None else None

    def _plan_round(self, tally: RoundTally) -> list[list[Prompt] | None]:
        """Rank 0: the next round's prompts per rank, or ``None`` for every rank to stop."""
        r, world_size = self.cfg.rollout, self.parallel.world_size
        if len(tally.kept) >= tally.target or tally.rounds >= r.max_sampling_rounds:
            return [None] * world_size
        prompts = self.sampler.next_batch(r.prompts_per_round)
        tally.prompts_drawn += len(prompts)
        return split_groups(prompts, world_size)


def model_context_tokens(model_path: str) -> int:
    """The model's ``max_position_embeddings`` (from its config.json), the default trajectory limit."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if not limit:
        raise ValueError(
            f"rollout.max_context_tokens (None) must be set because {model_path}'s config has no "
            "max_position_embeddings to default to; set rollout.max_context_tokens"
        )
    return int(limit)
