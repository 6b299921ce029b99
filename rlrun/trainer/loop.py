"""The synchronous RL loop: every rank runs this, step by step, in lockstep.

One step (``train_one_step``; each phase runs in the memory placement it needs, rlrun/trainer/offload.py):
  1. eval       when ``eval.interval`` says so: the eval sets generated and scored like a rollout
  2. rollout    the trainer sleeps, the engine wakes its KV cache; rank 0 draws prompts and scatters whole
                groups to ranks; each rank's engine generates ``samples_per_prompt`` responses with
                log-probs; rewards are scored on the rank; samples are gathered to rank 0
  3. scatter    the engine releases its memory, the trainer wakes; rank 0 turns each group's rewards into
                per-sample scores, drops tied groups, splits the kept groups into ``train.updates_per_rollout``
                updates, packs each update into micro-batches under a token budget, balances them over DP
                ranks and scatters a ``TrainBatch`` to every rank (rlrun/trainer/batch.py; TP peers of a DP
                rank receive the same micro-batches)
  4. logprobs   ``Actor.prepare``: critic values (PPO), old-policy / reference / teacher log-probs (role
                weights swapped in from CPU backups; the old-policy pass is skipped when the training forward
                can reuse it), per-token advantages, the post-process hook (rlrun/trainer/actor.py)
  5. train      ``Actor.train``: per update (and per epoch) the critic's value-loss step first (PPO), then
                Megatron forward/backward with the configured loss and an optimizer step
  6. sync       the engine's weights come back (every ``engine.sync_interval``-th step); Megatron -> HF names ->
                flattened buckets -> ZMQ; the old actor (``algorithm.keep_old_actor``) becomes those weights
  7. log        metrics.jsonl + console line on rank 0; between steps: stop request, checkpoint when due
With ``engine.max_restarts`` an engine lost in step 2 is restarted and the step redone from 1; one lost in
step 6 is restarted and re-synced, and the step goes on (rlrun/trainer/recovery.py).

    torchrun ─┬─ rank 0: Megatron shard + loop ──ZMQ──> engine worker 0
              └─ rank 1: Megatron shard + loop ──ZMQ──> engine worker 1
                 (rollout data and gradients move with torch.distributed)
With ``placement.engine_ranks`` the last ranks host the engines and the others only train (docs/async.md,
"Disaggregated placement"; rlrun/trainer/placement.py, rlrun/rollout/engine_rank.py).

Launch:  torchrun --standalone --nproc-per-node 2 -m rlrun train configs/quickstart.yaml
Slurm:   see launch/ (srun + torchrun with a c10d rendezvous on the first node).
"""

from __future__ import annotations

import gc

from rlrun.config.schema import RunConfig
from rlrun.data.sample import Sample
from rlrun.observability.metrics import PhaseTimer
from rlrun.rollout.debug_data import maybe_save_train_data
from rlrun.trainer.checkpoint import RunState
from rlrun.trainer.components import Components, scatter_train_batch, setup, sync_due


def run(cfg: RunConfig) -> bool:
    """Train to ``cfg.train.num_steps`` (resuming as ``checkpoint.resume`` says) or until SIGTERM/SIGUSR1
    asks to checkpoint and stop. A dead rank or engine worker ends every rank within seconds
    (rlrun/runtime/watchdog.py); the engine worker never outlives this call. Returns whether the process
    must end without Python's teardown (``Offloader.needs_hard_exit``: the CLI then calls ``os._exit``)."""
    from rlrun.observability.profiler import profile_step
    from rlrun.runtime.dist import DistEnv, destroy_distributed, init_distributed
    from rlrun.runtime.placement import all_ranks_started, is_engine_rank
    from rlrun.runtime.preemption import StopRequest
    from rlrun.runtime.watchdog import Watchdog
    from rlrun.trainer.ahead_step import start_ahead
    from rlrun.trainer.checkpoint import Checkpointer
    from rlrun.trainer.export import announce_outputs, export_at_end

    if is_engine_rank(DistEnv.from_env(), cfg.placement.engine_ranks):  # no trainer here (docs/async.md)
        from rlrun.rollout.engine_rank import serve

        return serve(cfg)
    parallel = init_distributed(
        cfg.parallel.tp,
        cfg.parallel.pp,
        cfg.train.seed,
        ep=cfg.parallel.ep,
        etp=cfg.parallel.etp,
        reloadable_backends=cfg.offload.reloadable_backends,
        cp=cfg.parallel.cp,
        engine_ranks=cfg.placement.engine_ranks,
    )
    if cfg.placement.engine_ranks:
        all_ranks_started(parallel.env)  # the engine ranks take no part in init_distributed's rendezvous
    stop, watchdog, parts, ahead = StopRequest.install(), Watchdog.start(parallel), None, None
    try:
        with stop.held():  # the engine worker inherits the blocked signals (rlrun/runtime/preemption.py)
            parts = setup(cfg, parallel, watchdog)
        if cfg.engine.max_restarts == 0:  # else a dead engine is restarted, not the end of the job
            watchdog.watch_engine(parts.engine.watched)
        if parts.rollout.teacher is not None:  # never restarted: its death ends the job
            watchdog.watch_engine(parts.rollout.teacher.client.watched, role="teacher engine")
        checkpointer = Checkpointer(cfg.checkpoint, cfg.logging.run_dir, parallel, model_path=cfg.model.path)
        resumed = parts.actor.restore(checkpointer, parts.sampler)
        state = RunState(**resumed) if resumed is not None else RunState()
        ahead = start_ahead(parts, state, checkpointer.restored_carry)  # rollout.max_staleness > 0 only
        if resumed is not None:
            sync_weights(parts, state.weight_version)  # the engine started from model.path's weights
        if parts.logger is not None:
            parts.logger.start(state.step)
        announce_outputs(cfg, parallel)
        stopping = False
        # The setup's objects (Megatron, transformers, torch) live for the whole run; frozen, they are not
        # walked again by each collection, such as the offloader's before every sleep.
        gc.freeze()
        while state.step < cfg.train.num_steps and not stopping:
            watchdog.step = state.step
            with profile_step(cfg.logging, parallel.rank, state.step):
                train_one_step(parts, state) if ahead is None else ahead.step(state)
            state.step += 1
            watchdog.step, watchdog.phase = state.step, "stop check"  # step N's save writes step_N
            stopping = stop.agreed(parallel.cpu_group)
            watchdog.phase = "checkpoint"
            checkpointer.poll()
            last = state.step == cfg.train.num_steps
            if checkpointer.due(state.step, last=last, stopping=stopping):
                parts.actor.save(
                    checkpointer,
                    state,
                    parts.sampler,
                    blocking=last or stopping,
                    carry=parts.rollout.carry_state() if ahead is None else ahead.carry_state(),
                )
        checkpointer.wait()
        export_at_end(parts.actor.model, cfg, state.step)  # RUN_DIR/model unless checkpoint.export_at_end is off
        watchdog.close(parallel.cpu_group)
    except BaseException as exc:
        watchdog.fail(exc)
        raise
    finally:
        gc.unfreeze()
        if ahead is not None:
            ahead.close()
        if parts is not None:
            parts.engine.shutdown()
            if parts.rollout.teacher is not None:
                parts.rollout.teacher.close()
            if parts.logger is not None:
                parts.logger.close()
        destroy_distributed()
    return parts.offloader.needs_hard_exit


def train_one_step(parts: Components, state: RunState) -> None:
    """One step, the module docstring's list; every phase runs on every rank."""
    cursor = parts.sampler.state_dict() if parts.sampler is not None else None
    phases, metrics = parts.offloader.phases(PhaseTimer(parts.logger, parts.watchdog)), {}
    if parts.rollout.eval_due(state.step):
        with phases("eval"):
            metrics.update(parts.rollout.evaluate(state.step))
    with phases("rollout"):
        samples = collect_rollout(parts, state.step, metrics)
    if recover_engines(parts, state, "rollout"):  # the same prompts again, on every rank
        if parts.sampler is not None and cursor is not None:
            parts.sampler.load_state_dict(cursor)
        return train_one_step(parts, state)  # recursion bounded by engine.max_restarts
    with phases("scatter"):
        batch = scatter_train_batch(parts, samples, metrics)
    if batch.updates:
        with phases("logprobs"):  # once over the whole rollout, before the first update
            metrics.update(parts.actor.prepare(batch, state.step))
            maybe_save_train_data(parts.cfg, state.step, parts.parallel.rank, batch.micro_batches)
        with phases("train"):
            metrics.update(parts.actor.train(batch, state.step))
    if sync_due(parts.cfg.engine.sync_interval, state.step, trained=bool(batch.updates)):
        with phases("sync"):  # reads the trainer's weights: the trainer sleeps at the next step's start
            state.weight_version += 1
            sync_weights(parts, state.weight_version)
    metrics.update(phases.finish())  # the engine gets its weights back also when nothing trained
    recover_engines(parts, state, "sync")  # the restarted engine gets this step's weights; the step stands
    metrics.update(parts.recovery.step_metrics())
    if parts.logger is not None:
        parts.logger.log(state.step, metrics, samples)


def collect_rollout(parts: Components, step: int, metrics: dict[str, float]) -> list[Sample] | None:
    """Generate and score on every rank, refilling while a dynamic filter drops groups
    (rlrun/rollout/collect.py); rank 0 returns the kept samples in prompt-major order."""
    batch = parts.rollout.collect(step)
    if batch is None:
        return None
    metrics.update(batch.metrics)
    return batch.samples


def sync_weights(parts: Components, version: int) -> None:
    """Push the trainer's weights to this rank's engine as HF-named flattened buckets (its group's
    leader does; the other ranks of an engine group only take part in the export's collectives); the old
    actor (``algorithm.keep_old_actor``) becomes these weights."""
    parts.engine.update_weights(
        parts.actor.export_weights(),
        weight_version=str(version),
        bucket_bytes=parts.cfg.engine.bucket_bytes,
        verify=parts.cfg.engine.verify_weights,
    )
    parts.actor.on_weights_synced()


def recover_engines(parts: Components, state: RunState, phase: str) -> bool:
    """Collective: restart and re-sync the engines lost in ``phase`` (rlrun/trainer/recovery.py); whether any was."""

    def resync(send: bool) -> None:
        if send:
            sync_weights(parts, state.weight_version)
        else:  # the export's collectives, with the restarted ranks
            for _ in parts.actor.export_weights():
                pass

    if not parts.recovery.recover(state.step, phase, resync):
        return False
    parts.rollout.engine = parts.engine.client  # the new worker's client (None on an engine group's members)
    return True
