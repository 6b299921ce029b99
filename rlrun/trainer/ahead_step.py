"""The loop's step when rollouts are generated ahead of training (``rollout.max_staleness`` K > 0).

The engines generate step n+1 (up to n+K) on a background thread while the trainer trains step n
(rlrun/rollout/ahead.py); the step itself is the synchronous one with two changes:
  rollout  waits for this step's batch, launched up to K steps earlier, and logs how many weight versions
           behind the trainer each sample is (``rollout/versions_behind_*``)
  sync     exports the trained weights once (a copy the trainer's next update cannot change) and publishes
           them; the rollout thread pushes them into the engine before the first rollout they may sample
With ``rollout.continue_after_tokens`` (K >= 2) each rollout continues its long samples under the update
published while it runs (rlrun/rollout/segments.py): its tokens carry their versions (``Sample.weight_spans``)
and ``rollout/versions_behind_*`` count them per token.
The importance ratios then compare the trainer's old log-probs against the older sampling policy's; the
mismatch corrections (``algorithm.tis``) and diagnostics (``train/mismatch_k3``: KL(sampling || trainer))
apply unchanged. The engine stays resident while the trainer trains (no offload of either).

Engine restarts (``engine.max_restarts``): a lost engine surfaces on the rollout thread, in a rollout or in the
push before one. The thread's ranks agree on it after each rollout and raise ``RolloutLost``; the schedule
runs nothing more. When the main thread next waits for a rollout (the step's batch, eval's or a checkpoint's
drain), it restarts the engine with the synchronous loop's recovery (rlrun/trainer/recovery.py), rewinds rank
0's sampler to the lost rollout's first prompts and launches it and the later ones again: each under the
weights the schedule gave it (kept until a rollout under newer ones starts), with the same prompts and seeds,
so the run's metrics are an uninterrupted run's.

Exact resume: a checkpoint waits for the rollouts in flight and saves their batches (``rollout_carry.pt``)
with the sampler cursor past their prompts; a resumed run trains them first, then goes on as the
uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.distributed as dist

from rlrun.data.sample import Sample
from rlrun.data.transfer import all_gather
from rlrun.observability.metrics import PhaseTimer
from rlrun.rollout.ahead import Published, RolloutAhead, RolloutLost, versions_behind
from rlrun.rollout.debug_data import maybe_save_train_data
from rlrun.rollout.segments import SegmentedGeneration
from rlrun.rollout.tally import RolloutBatch
from rlrun.trainer.checkpoint import RunState
from rlrun.trainer.components import scatter_train_batch, sync_due

if TYPE_CHECKING:
    from rlrun.trainer.components import Components

CARRY_KIND = "rollout_ahead"


class AheadLoop:
    """One rank's rollout thread and the step that trains while it generates."""

    def __init__(self, parts: Components, state: RunState) -> None:
        cfg = parts.cfg
        # Collective (every rank, once): the thread's rollout collectives get a gloo group of their own, so
        # they never interleave with the ones the trainer runs at the same time on ``cpu_group``.
        group = dist.new_group(backend="gloo")
        self.parts = parts
        # With restarts, a copy of the weights the engine starts with (collective export): a redo may load them.
        start = self._exported(state.weight_version) if cfg.engine.max_restarts else None
        self.ahead: RolloutAhead[RolloutBatch | None] = RolloutAhead(
            self._collect, self._push, cfg.rollout.max_staleness, state.step, cfg.train.num_steps, start
        )
        self.segments = (
            SegmentedGeneration(self.ahead.enter_segment) if cfg.rollout.continue_after_tokens is not None else None
        )
        parallel = dataclasses.replace(parts.parallel, cpu_group=group)
        if self.segments is None:
            self.runtime = dataclasses.replace(parts.rollout, parallel=parallel)
        else:  # a colocated runtime (continuation is refused with engine ranks, whose stand-in has no segments)
            self.runtime = dataclasses.replace(parts.rollout, parallel=parallel, segments=self.segments)

    def _collect(self, step: int) -> RolloutBatch | None:
        """On the rollout thread: step ``step``'s batch (segment 0's weights are loaded). With
        ``engine.max_restarts``, raises ``RolloutLost`` on every rank when any rank's engine was lost, the
        sampler rewound to the rollout's first prompts."""
        sampler, restarts = self.parts.sampler, self.parts.cfg.engine.max_restarts
        cursor = sampler.state_dict() if sampler is not None and restarts else None
        if self.segments is not None:
            self.segments.start(step)
        batch = self.runtime.collect(step)
        if restarts:
            losses = [why for why in all_gather(self.parts.engine.lost, self.runtime.parallel.cpu_group) if why]
            if losses:
                if sampler is not None and cursor is not None:
                    sampler.load_state_dict(cursor)
                raise RolloutLost(step, "; ".join(losses))
        return batch

    def _recover(self, lost: RolloutLost) -> None:
        """Collective, on the main thread once no rollout runs: restart the lost engines (rlrun/trainer/recovery.py;
        the engine limit applies), then launch the lost rollout and the later ones again. The re-sync is the
        rollout thread's: before each rollout it loads the weights the schedule gave it."""
        self.ahead.wait_idle()  # the rollouts queued behind the lost one stop at once
        parts, restarted = self.parts, False

        def resync(here: bool) -> None:
            nonlocal restarted
            restarted = here

        recovered = parts.recovery.recover(lost.step, "rollout ahead", resync)
        assert recovered, f"{lost} but no rank reports a lost engine"
        parts.rollout.engine = self.runtime.engine = parts.engine.client  # the new worker's client
        self.ahead.redo(lost.step, engine_restarted=restarted)

    def _settled(self) -> dict[int, RolloutBatch | None]:
        """Collective: wait until no rollout runs, restarting lost engines and redoing their rollouts; the
        launched batches."""
        while True:
            try:
                return self.ahead.drain()
            except RolloutLost as lost:
                self._recover(lost)

    def _push(self, published: Published) -> None:
        """On the rollout thread, between rollouts: the engine takes published weights."""
        self.parts.engine.update_weights(
            iter(published.weights),
            weight_version=str(published.version),
            bucket_bytes=self.parts.cfg.engine.bucket_bytes,
            verify=self.parts.cfg.engine.verify_weights,
        )

    def step(self, state: RunState) -> None:
        """One step (rlrun/trainer/loop.py's, with the rollout waited for and the sync published)."""
        parts = self.parts
        phases, metrics = parts.offloader.phases(PhaseTimer(parts.logger, parts.watchdog)), {}
        if parts.rollout.eval_due(state.step):
            self._settled()  # the engine serves one caller at a time
            with phases("eval"):
                metrics.update(parts.rollout.evaluate(state.step))
        with phases("rollout"):  # only the wait: the rollout ran while earlier steps trained
            self.ahead.launch_until(state.step)
            samples = self._take(state, metrics)
        with phases("scatter"):
            batch = scatter_train_batch(parts, samples, metrics)
        if batch.updates:
            with phases("logprobs"):
                metrics.update(parts.actor.prepare(batch, state.step))
                maybe_save_train_data(parts.cfg, state.step, parts.parallel.rank, batch.micro_batches)
            with phases("train"):
                metrics.update(parts.actor.train(batch, state.step))
        published = None
        if sync_due(1, state.step, trained=bool(batch.updates)):
            with phases("sync"):  # the export is collective; the push happens on the rollout thread
                state.weight_version += 1
                published = self._exported(state.weight_version)
                parts.actor.on_weights_synced()
        self.ahead.publish(state.step, published)  # also when None: a rollout may wait for this step to end
        metrics.update(phases.finish())
        metrics.update(parts.recovery.step_metrics())
        if parts.logger is not None:
            parts.logger.log(state.step, metrics, samples)

    def _exported(self, version: int) -> Published:
        """Collective: the trainer's weights as a copy its next update cannot change (the export's views copied)."""
        return Published(version, [(name, t.detach().clone()) for name, t in self.parts.actor.export_weights()])

    def _take(self, state: RunState, metrics: dict[str, float]) -> list[Sample] | None:
        while True:
            try:
                rollout = self.ahead.take(state.step)
                break
            except RolloutLost as lost:  # every rank alike: the rollout thread's ranks agreed on it
                self._recover(lost)
        if rollout is None:  # not rank 0
            return None
        metrics.update(rollout.metrics)
        spans = [s.weight_spans or [(s.weight_version, len(s.response_ids))] for s in rollout.samples]
        metrics.update(versions_behind(state.weight_version, spans))
        return rollout.samples

    def carry_state(self) -> list | None:
        """Collective wait, then rank 0's launched, untrained batches as plain data for the checkpoint (the
        sampler's cursor, saved beside them, is past their prompts)."""
        batches = self._settled()
        if not self.parts.parallel.is_rank0:
            return None
        return [
            {
                "kind": CARRY_KIND,
                "step": step,
                "metrics": dict(b.metrics),
                "samples": [dataclasses.asdict(s) for s in b.samples],
            }
            for step, b in batches.items()
            if b is not None
        ]

    def restore(self, state: list | None) -> None:
        """Take back a checkpoint's batches (rank 0), and on every rank skip launching their steps again."""
        from rlrun.data.transfer import scatter_from_rank0

        parallel = self.parts.parallel
        rows = (state or []) if parallel.is_rank0 else []
        if any(not isinstance(row, dict) or row.get("kind") != CARRY_KIND for row in rows):
            raise ValueError(
                "rollout.max_staleness (> 0) cannot resume this checkpoint because its rollout_carry.pt holds "
                "partial-rollout groups, not batches generated ahead; set rollout.max_staleness: 0 and "
                "rollout.partial_rollout: true as the saving run had, or checkpoint.resume: none"
            )
        plan = [[row["step"] for row in rows]] * parallel.world_size if parallel.is_rank0 else None
        by_step = {row["step"]: row for row in rows}
        for step in scatter_from_rank0(plan, parallel.cpu_group):
            row = by_step.get(step)
            batch = RolloutBatch([Sample.from_dict(s) for s in row["samples"]], row["metrics"]) if row else None
            self.ahead.put(step, batch)

    def close(self) -> None:
        self.ahead.close()


def start_ahead(parts: Components, state: RunState, carry: list | None) -> AheadLoop | None:
    """Collective, after a restore: the rollout thread with the checkpoint's batches (``rollout.max_staleness``
    > 0), or None for the synchronous loop, given the checkpoint's partial-rollout carry instead."""
    if parts.cfg.rollout.max_staleness == 0:
        parts.rollout.restore_carry(carry)
        return None
    ahead = AheadLoop(parts, state)
    ahead.restore(carry)
    return ahead
