"""One step's rollout across ranks: draw prompts, generate and score on every rank, filter groups on
rank 0, and draw again until the batch is full.

    round r:  rank 0 draws ``prompts_per_round`` prompts ──scatter whole groups──> every rank
              every rank: generate (engine, generate_fn or rollout_fn) + score ──gather──> rank 0
                          (engine.tp > 1: each group's leader generates its group's prompts)
              rank 0: dynamic filter keeps whole groups; enough kept or ``max_sampling_rounds``? stop
    (the stop is itself a scatter of ``None`` to every rank, so all ranks leave the loop together)

With ``rollout.abort_surplus`` / ``rollout.partial_rollout`` the rounds stream instead (one engine call
per group, rank 0 told at every tick which groups finished; rlrun/rollout/streaming.py): the groups still
generating when the batch is full are aborted, and with partial rollout carried into the next step,
whose first round generates them first.

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
from rlrun.engine.group import EngineLost
from rlrun.rollout.debug_data import load_rollout, save_rollout
from rlrun.rollout.driver import generate_samples, group_samples, split_groups
from rlrun.rollout.evaluate import Evaluator
from rlrun.rollout.filters import GroupFilter
from rlrun.rollout.hook_specs import load_hooks
from rlrun.rollout.rewards import score_samples
from rlrun.rollout.rewards.post_process import RewardPostProcess, post_process_rewards
from rlrun.rollout.rewards.select import RewardByType, load_rewards
from rlrun.rollout.rollout_fn import RolloutContext, RolloutFn
from rlrun.rollout.segments import SegmentedGeneration
from rlrun.rollout.streaming import (
    TICK_S,
    GroupJob,
    GroupStream,
    carry_from_state,
    carry_to_state,
    is_unfinished,
    mask_older_weights,
    partial_rollout_metrics,
)
from rlrun.rollout.tally import RolloutBatch, RoundTally
from rlrun.rollout.teacher import TeacherEngine
from rlrun.rollout.train_samples import SampleToTrain

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutHooks:
    """The rollout's user-replaceable functions, resolved from ``rollout.*`` specs (each optional one is a row of
    :data:`rlrun.rollout.hook_specs.HOOK_LOADERS`, under its config key's name)."""

    reward_fn: Callable | None
    """None only when the agent's return is the reward (``rollout.agent`` with ``agent_scores``, no ``reward``)."""
    generate_fn: Callable | None
    dynamic_filter: GroupFilter | None
    reward_post_process: RewardPostProcess | None = None
    sample_to_train: SampleToTrain | None = None
    """Used by rank 0's batch planner (rlrun/trainer/batch.py), after the group scores."""
    rollout_fn: RolloutFn | None = None
    """Replaces the generation of the training rounds (rlrun/rollout/rollout_fn.py); eval generates as usual."""
    agent: Callable | None = None
    """``rollout.agent``: unchanged agent code on the rank's OpenAI-compatible endpoint (rlrun/agents/runner.py)."""

    @classmethod
    def load(cls, r: RolloutConfig) -> RolloutHooks:
        """Import every hook the config names; raises ``RewardSpecError`` / ``HookSpecError`` naming the key
        (cheap: call it when the config is loaded, so a bad path fails before any model loads)."""
        return cls(reward_fn=None if r.reward is None else load_rewards(r), **load_hooks(r))


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
    teacher: TeacherEngine | None = None
    """This rank's teacher engine (``algorithm.opd.teacher_engine``): scores the rank's rollout samples."""
    carry: list[list[Sample]] = field(default_factory=list)
    """Rank 0, ``rollout.partial_rollout``: groups aborted (or kept beyond the batch) at the last step's end,
    generated first in the next step. Checkpointed (:meth:`carry_state`), so a resumed run trains them."""
    segments: SegmentedGeneration | None = None
    """The rollout thread's copy with ``rollout.continue_after_tokens``: generation continues the samples cut
    at the token boundary under the weights published meanwhile (rlrun/rollout/segments.py). None: one call."""

    @property
    def streams(self) -> bool:
        """Whether rounds stream groups and abort the rest once the batch is full (rlrun/rollout/streaming.py)."""
        return self.cfg.rollout.streams

    @classmethod
    def build(cls, cfg: RunConfig, parallel, engine, tokenizer, sampler, group=None, teacher=None) -> RolloutRuntime:
        runtime = cls(
            cfg=cfg,
            parallel=parallel,
            engine=engine,
            tokenizer=tokenizer,
            sampler=sampler,
            hooks=RolloutHooks.load(cfg.rollout),
            group=group,
            teacher=teacher,
        )
        if sampler is not None and isinstance(runtime.hooks.reward_fn, RewardByType):
            runtime.hooks.reward_fn.check(sampler.dataset.prompts, cfg.data.path)
        if runtime.hooks.generate_fn is not None or runtime.hooks.agent is not None:
            runtime.max_context_tokens = cfg.rollout.max_context_tokens or model_context_tokens(cfg.model.path)
        if cfg.eval.interval > 0:
            runtime.evaluator = Evaluator(runtime, tokenizer)
        return runtime

    def carry_state(self) -> list | None:
        """Rank 0 with partial rollout: the carry as plain data for the checkpoint; None elsewhere."""
        if not (self.parallel.is_rank0 and self.cfg.rollout.partial_rollout):
            return None
        return carry_to_state(self.carry)

    def restore_carry(self, state: list | None) -> None:
        """Rank 0: take back a checkpoint's carry. Its prompts count as drawn (the sampler's cursor is past
        them), so dropping it would lose them for good: a run without partial rollout refuses it."""
        if not state:
            return
        if not self.cfg.rollout.partial_rollout:
            raise ValueError(
                f"rollout.partial_rollout (false) must be true to resume this checkpoint because it carries "
                f"{len(state)} drawn, untrained groups (saved by a partial-rollout run; the data position is past "
                "them, so they would never train); set rollout.partial_rollout: true, or checkpoint.resume: none"
            )
        self.carry = carry_from_state(state)

    def eval_due(self, step: int) -> bool:
        """Whether ``eval.interval`` says this step evaluates (before its rollout)."""
        return self.evaluator is not None and self.evaluator.due(step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Eval metrics (rank 0; ``{}`` elsewhere); every rank takes part. Call when :meth:`eval_due`."""
        assert self.evaluator is not None, "evaluate() without eval.interval > 0"
        return self.evaluator.run(step)

    def generate_and_score(
        self,
        prompts: list[Prompt],
        seed: int,
        rollout_cfg: RolloutConfig | None = None,
        reward_fn=None,
        round_at: tuple[int, int] | None = None,
    ) -> list[Sample] | EngineLost:
        """This rank's share: generate ``samples_per_prompt`` responses per prompt and score them (with
        ``reward_fn``, by default the run's). A training round (``round_at``: its step and index) generates
        with ``rollout.rollout_fn`` when set. In an engine group every rank passes its share and gets its
        own samples back, but the leader generates and scores the whole group's prompts in one call (with its
        ``seed``). ``EngineLost`` when the group's engine is lost and the group tolerates it
        (``engine.max_restarts``)."""
        r, fn = rollout_cfg or self.cfg.rollout, reward_fn or self.hooks.reward_fn
        if self.group is None:
            return self._generate_and_score_here(prompts, seed, r, fn, round_at)
        return self.group.run_on_leader(
            prompts,
            lambda group_prompts: self._generate_and_score_here(group_prompts, seed, r, fn, round_at),
            r.samples_per_prompt,
        )

    def _generate(self, prompts: list[Prompt], r: RolloutConfig, seed: int) -> list[Sample]:
        if self.segments is not None:
            return self.segments.generate(self.engine, prompts, r, seed, self.tokenizer)
        return generate_samples(
            self.engine,
            prompts,
            r,
            seed,
            self.tokenizer,
            self.hooks.generate_fn,
            self.max_context_tokens,
            agent=self.hooks.agent,
            model_name=self.cfg.model.path,
        )

    def _generate_and_score_here(
        self, prompts: list[Prompt], seed: int, r: RolloutConfig, fn, round_at: tuple[int, int] | None
    ) -> list[Sample]:
        rollout_fn = self.hooks.rollout_fn if round_at is not None and prompts else None
        if rollout_fn is None:
            samples = self._generate(prompts, r, seed)
        else:
            ctx = RolloutContext(*round_at, prompts, seed, r, self.engine, self.tokenizer, self._generate)
            samples = rollout_fn.run(ctx, scored=r.rollout_fn_scores)
            if r.rollout_fn_scores:
                return samples
        self._score(samples, fn, r)
        return samples

    @staticmethod
    def _score(samples: list[Sample], fn, r: RolloutConfig) -> None:
        """Score with ``r``'s reward options: one place for the sampling rounds, the streaming rounds and eval."""
        if r.agent is not None and r.agent_scores:
            return  # the agents' returns are the rewards (rlrun/agents/runner.py)
        score_samples(
            samples,
            fn,
            group_size=r.samples_per_prompt if r.reward_per_group else None,
            concurrency=r.reward_concurrency,
            timeout_s=r.reward_timeout_s,
            reward_key=r.reward_key,
            processes=r.reward_processes,
        )

    def collect(self, step: int) -> RolloutBatch | None:
        """Sampling rounds until the batch is full; rank 0 gets the batch, the other ranks None.

        With ``debug.load_rollout_data`` rank 0 reads the step's saved batch instead (no engine
        call); with ``debug.save_rollout_data`` it writes the batch it returns, with the rewards before
        ``rollout.reward_post_process`` (which runs last, on loaded batches too).
        """
        debug = self.cfg.debug
        if debug.load_rollout_data:
            samples = load_rollout(debug.load_rollout_data, step) if self.parallel.is_rank0 else None
            batch = RolloutBatch(samples, {"rollout/loaded_from_disk": 1.0}) if samples is not None else None
        else:
            batch = self._stream_rounds(step) if self.streams else self._sample_rounds(step)
            if batch is not None and debug.save_rollout_data:
                save_rollout(self.debug_dir, step, batch.samples)
        if batch is not None and self.hooks.reward_post_process is not None:
            batch.metrics.update(post_process_rewards(self.hooks.reward_post_process, batch.samples))
        return batch

    def _new_tally(self) -> RoundTally | None:
        """Rank 0's bookkeeping of one step's rounds (None on the other ranks)."""
        if not self.parallel.is_rank0:
            return None
        return RoundTally(target=self.cfg.rollout.prompts_per_step, source_key=self.cfg.data.source_key)

    @property
    def debug_dir(self) -> Path:
        return Path(self.cfg.logging.run_dir) / "debug"

    def round_seed(self, step: int, rank: int, round_index: int) -> int:
        """The sampling seed of ``rank``'s share of ``step``'s round ``round_index``: one per share, so a
        resumed or restarted round samples what the original did, wherever the share is generated."""
        return self.cfg.train.seed * 1_000_003 + step * 1009 + rank + 104_729 * round_index

    def _sample_rounds(self, step: int) -> RolloutBatch | None:
        r, parallel = self.cfg.rollout, self.parallel
        tally = self._new_tally()
        for round_index in itertools.count():
            plan = self._plan_round(tally) if tally is not None else None
            prompts = scatter_from_rank0(plan, parallel.cpu_group)
            if prompts is None:
                break
            seed = self.round_seed(step, parallel.rank, round_index)
            samples = self.generate_and_score(prompts, seed, round_at=(step, round_index))
            if self.teacher is not None:
                self.teacher.score(samples)
            gathered = gather_to_rank0(samples, parallel.cpu_group)
            if tally is not None:
                tally.engine_lost = any(isinstance(rank_samples, EngineLost) for rank_samples in gathered)
                kept = [s for part in gathered if not isinstance(part, EngineLost) for s in part]
                tally.add_round(group_samples(kept, r.samples_per_prompt), self.hooks.dynamic_filter)
        return tally.batch() if tally is not None else None

    def _stream_rounds(self, step: int) -> RolloutBatch | None:
        """Sampling rounds of one engine call per group, aborting what still generates once the batch is
        full (rlrun/rollout/streaming.py); rank 0 returns the batch, with the carry for the next step."""
        r, parallel = self.cfg.rollout, self.parallel
        tally = self._new_tally()
        pending: list[GroupJob] = []
        if tally is not None:
            carried, self.carry = self.carry, []
            tally.add_groups([g for g in carried if not any(is_unfinished(s) for s in g)], self.hooks.dynamic_filter)
            pending = [GroupJob(g[0].prompt, g) for g in carried if any(is_unfinished(s) for s in g)]
        for round_index in itertools.count():
            plan = self._plan_stream_round(tally, pending) if tally is not None else None
            jobs = scatter_from_rank0(plan, parallel.cpu_group)
            if jobs is None:  # carried groups of an unstarted round stay pending (carried again below)
                break
            pending = []
            seed = self.round_seed(step, parallel.rank, round_index)
            self._stream_one_round(jobs, seed, tally)
        if tally is None:
            return None
        batch = tally.batch()
        surplus = tally.kept[tally.target :]
        if r.partial_rollout:  # nothing drawn is thrown away: aborted and surplus groups train in a later step
            # Oldest first: carried groups whose continuation never started (the carried finished groups
            # alone filled the batch, or no round was left), then this step's aborted ones and the surplus.
            self.carry = [job.carried for job in pending if job.carried is not None] + tally.aborted + surplus
        batch.metrics.update(partial_rollout_metrics(tally, batch.samples, self.carry, r.partial_rollout))
        if r.partial_rollout_mask_offpolicy:
            batch.metrics["rollout/offpolicy_masked_tokens"] = sum(mask_older_weights(s) for s in batch.samples)
        return batch

    def _stream_one_round(self, jobs: list[GroupJob], seed: int, tally: RoundTally | None) -> None:
        """Every rank: generate its groups until rank 0 says the batch is full or nothing is left."""
        r = self.cfg.rollout

        def score(samples: list[Sample]) -> None:
            self._score(samples, self.hooks.reward_fn, r)
            if self.teacher is not None:
                self.teacher.score(samples)

        stream = GroupStream(self.engine, r, seed, self.tokenizer, score)
        stream.add(jobs)
        decision, cpu_group = "go", self.parallel.cpu_group
        while decision == "go":
            reports = gather_to_rank0((stream.take_done(TICK_S), stream.num_open, stream.error), cpu_group)
            plan = self._decide(tally, reports) if tally is not None else None
            decision, more = scatter_from_rank0(plan, cpu_group)
            stream.add(more)
        if decision.startswith("fail"):
            stream.close()
            raise RuntimeError(f"rollout {decision}")
        leftover, wait_s = stream.abort_and_drain() if decision == "abort" else (stream.take_done(0), 0.0)
        stream.close()
        reports = gather_to_rank0((leftover, wait_s), self.parallel.cpu_group)
        if tally is not None:
            for outcomes, rank_wait_s in reports:
                tally.add_groups([o.samples for o in outcomes if not o.aborted], self.hooks.dynamic_filter)
                tally.aborted += [o.samples for o in outcomes if o.aborted]
                tally.abort_wait_s = max(tally.abort_wait_s, rank_wait_s)

    def _decide(self, tally: RoundTally, reports: list) -> list[tuple[str, list[GroupJob]]]:
        """Rank 0 at a tick, per rank: ``go`` on (with more groups when the kept and the generating ones
        cannot fill the batch: slime's refill, drawn as soon as it is known to be needed), ``abort`` (batch
        full), ``end`` (nothing generating, nothing more to draw) or ``fail: ...``."""
        r, world_size = self.cfg.rollout, self.parallel.world_size
        errors = [f"rank {rank}: {error}" for rank, (_, _, error) in enumerate(reports) if error]
        if errors:
            return [("fail: " + "; ".join(errors), [])] * world_size
        for outcomes, _, _ in reports:
            tally.add_groups([o.samples for o in outcomes if not o.aborted], self.hooks.dynamic_filter)
            tally.aborted += [o.samples for o in outcomes if o.aborted]
        if tally.full:
            return [("abort", [])] * world_size
        num_open = sum(n for _, n, _ in reports)
        if len(tally.kept) + num_open < tally.target and tally.rounds < r.max_sampling_rounds:
            return [("go", jobs) for jobs in self._draw_jobs(tally, [])]
        return [("end" if num_open == 0 else "go", [])] * world_size

    def _plan_stream_round(self, tally: RoundTally, carried: list[GroupJob]) -> list[list[GroupJob]] | None:
        """Rank 0: the round's groups per rank (carried ones first, then fresh prompts), or ``None`` to stop."""
        if tally.full or tally.rounds >= self.cfg.rollout.max_sampling_rounds:
            return [None] * self.parallel.world_size
        return self._draw_jobs(tally, carried)

    def _draw_jobs(self, tally: RoundTally, carried: list[GroupJob]) -> list[list[GroupJob]]:
        """Rank 0: one draw (a sampling round) of ``prompts_per_round`` groups, the carried ones counted
        first, split over the ranks."""
        tally.rounds += 1
        tally.last_round = []
        num_fresh = self.cfg.rollout.prompts_per_round - len(carried)
        fresh = self.sampler.next_batch(num_fresh) if num_fresh > 0 else []
        tally.prompts_drawn += len(fresh)
        return split_groups(carried + [GroupJob(p) for p in fresh], self.parallel.world_size)

    def _plan_round(self, tally: RoundTally) -> list[list[Prompt] | None]:
        """Rank 0: the next round's prompts per rank, or ``None`` for every rank to stop."""
        r, world_size = self.cfg.rollout, self.parallel.world_size
        if len(tally.kept) >= tally.target or tally.rounds >= r.max_sampling_rounds or tally.engine_lost:
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
