"""The synchronous RL loop: every rank runs this, step by step, in lockstep.

One step:
  1. rollout    rank 0 draws prompts and scatters whole groups to ranks; each rank's engine
                generates ``samples_per_prompt`` responses with log-probs; rewards are scored on
                the rank; samples are gathered to rank 0
  2. engine sleeps (release_memory_occupation), trainer wakes
  3. scores     rank 0 turns each group's rewards into per-sample scores and drops tied groups
  4. scatter    rank 0 splits the kept groups into ``train.updates_per_rollout`` updates, packs each
                update's samples into micro-batches under a token budget, balances them over DP ranks
                and scatters them (TP peers of a DP rank receive the same micro-batches)
  5. log-probs  critic values (PPO, rlrun/critic.py), old-policy / reference / teacher log-probs, role
                weights swapped in from CPU backups (rlrun/roles.py; the old-policy pass is skipped
                when the training forward can reuse it), then per-token advantages (rlrun/algo) and
                the post-process hook
  6. train      per update (and per epoch): the critic's value-loss step first (PPO), then Megatron
                forward/backward with the configured loss (rlrun/algo/objective.py) and an optimizer
                step; role backups refreshed after the last update
  7. engine wakes for weights; weight sync (Megatron -> HF names -> flattened buckets -> ZMQ);
                the trainer sleeps and the engine wakes its KV cache when the next step starts
  8. log        metrics.jsonl + console line on rank 0

    torchrun ─┬─ rank 0: Megatron shard + loop ──ZMQ──> engine worker 0
              └─ rank 1: Megatron shard + loop ──ZMQ──> engine worker 1
                 (rollout data and gradients move with torch.distributed)

Launch:  torchrun --standalone --nproc-per-node 2 -m rlrun train configs/quickstart.yaml
Slurm:   see launch/ (srun + torchrun with a c10d rendezvous on the first node).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rlrun.algo.advantages import score_groups
from rlrun.config.load import dump_config
from rlrun.config.schema import RunConfig
from rlrun.data.batch import MicroBatch, schedule_micro_batches
from rlrun.data.sample import Sample
from rlrun.data.transfer import all_gather, scatter_from_rank0
from rlrun.metrics import MetricsLogger, PhaseTimer
from rlrun.offload import Offloader
from rlrun.rollout.collect import RolloutRuntime
from rlrun.rollout.debug_data import maybe_save_train_data
from rlrun.rollout.driver import group_samples


@dataclass
class RunState:
    """Everything that changes as the run goes and must survive a restart (rlrun/checkpoint.py saves it
    as JSON, so fields must be JSON values; rank 0's prompt-sampler cursor is saved beside it)."""

    step: int = 0
    """Steps completed."""
    weight_version: int = 0
    """Version of the weights the engine holds (bumped by every sync)."""


@dataclass
class Update:
    """One optimizer update's share of a rollout on this rank: its micro-batches and the update's global
    count of loss tokens (every rank's), which normalises the update's loss."""

    micro_batches: list[MicroBatch]
    num_global_tokens: int


@dataclass
class Components:
    """What one rank holds for the whole run (built once by :func:`setup`)."""

    cfg: RunConfig
    parallel: object
    model: object
    optimizer: object
    scheduler: object  # Megatron's OptimizerParamScheduler: the actor's LR schedule
    roles: object  # rlrun.roles.ModelRoles
    critic: object | None  # rlrun.critic.Critic when the run trains one (PPO)
    engine: object
    offloader: Offloader
    tokenizer: object
    sampler: object | None  # rank 0 only
    rollout: object  # rlrun.rollout.collect.RolloutRuntime: engine calls, rewards, hooks, filter
    dp_rank_of: list[int]
    logger: MetricsLogger | None  # rank 0 only


def run(cfg: RunConfig) -> None:
    """Train to ``cfg.train.num_steps`` (resuming as ``checkpoint.resume`` says) or until SIGTERM/SIGUSR1
    asks to checkpoint and stop. A dead rank or engine worker ends every rank within seconds
    (rlrun/runtime/watchdog.py); the engine worker never outlives this call."""
    from rlrun.checkpoint import Checkpointer
    from rlrun.profiler import profile_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.runtime.preemption import StopRequest
    from rlrun.runtime.watchdog import Watchdog

    parallel = init_distributed(
        cfg.parallel.tp,
        cfg.parallel.pp,
        cfg.train.seed,
        ep=cfg.parallel.ep,
        etp=cfg.parallel.etp,
        reloadable_backends=cfg.offload.reloadable_backends,
    )
    stop, watchdog, parts = StopRequest.install(), Watchdog.start(parallel), None
    try:
        with stop.held():  # the engine worker inherits the blocked signals (rlrun/runtime/preemption.py)
            parts = setup(cfg, parallel)
        watchdog.watch_engine(parts.engine.process, parts.engine.log_path)
        checkpointer = Checkpointer(cfg.checkpoint, cfg.logging.run_dir, parallel, model_path=cfg.model.path)
        resumed = checkpointer.restore(
            parts.model, parts.optimizer, parts.sampler, critic=parts.critic, scheduler=parts.scheduler
        )
        state = RunState(**resumed) if resumed is not None else RunState()
        if resumed is not None:
            parts.roles.on_actor_loaded()
            sync_weights(parts, state.weight_version)  # the engine started from model.path's weights
        if parts.logger is not None:
            parts.logger.start(state.step)
        stopping = False
        # The setup's objects (~0.5M: Megatron, transformers, torch) live for the whole run; frozen, they
        # are not walked again by each collection (the offloader's before every sleep took 0.3 s of it).
        gc.freeze()
        while state.step < cfg.train.num_steps and not stopping:
            watchdog.step = state.step
            with profile_step(cfg.logging, parallel.rank, state.step):
                train_one_step(parts, state)
            state.step += 1
            stopping = stop.agreed(parallel.cpu_group)
            checkpointer.poll()
            last = state.step == cfg.train.num_steps
            if checkpointer.due(state.step, last=last, stopping=stopping):
                checkpointer.save(
                    state,
                    parts.model,
                    parts.optimizer,
                    parts.sampler,
                    blocking=last or stopping,
                    scheduler=parts.scheduler,
                    critic=parts.critic,
                )
        checkpointer.wait()
        watchdog.close(parallel.cpu_group)
    except BaseException as exc:
        watchdog.fail(exc)
        raise
    finally:
        gc.unfreeze()
        if parts is not None:
            parts.engine.shutdown()
            if parts.logger is not None:
                parts.logger.close()
        destroy_distributed()
    parts.offloader.close()


def setup(cfg: RunConfig, parallel) -> Components:
    from transformers import AutoTokenizer

    from rlrun.critic import Critic
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.engine.backends import BackendSpec
    from rlrun.engine.group import EngineGroup, GroupLayout
    from rlrun.megatron import build_model, make_optimizer_and_scheduler
    from rlrun.megatron.moe import MoEOptions
    from rlrun.roles import ModelRoles

    run_dir = Path(cfg.logging.run_dir)
    if parallel.is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    dist.barrier(group=parallel.cpu_group)
    # The engine starts before Megatron allocates (SGLang sizes its KV cache from free memory); with
    # engine.tp > 1 only each group's leader starts one (rlrun/engine/group.py).
    env = parallel.env
    layout = GroupLayout.of(cfg.engine.tp, env.rank, env.local_rank, env.world_size, env.local_world_size)
    engine = EngineGroup.spawn(
        layout,
        BackendSpec.from_config(cfg, seed=cfg.train.seed + parallel.rank),
        run_dir=run_dir,
        rank=parallel.rank,
        startup_timeout_s=cfg.engine.startup_timeout_s,
        request_timeout_s=cfg.engine.request_timeout_s,
        heartbeat_timeout_s=cfg.engine.heartbeat_timeout_s,
    )
    offloader = Offloader(cfg.offload, engine, parallel.device)
    with offloader.trainer_region():  # weights, grad buffers and optimizer state (actor and critic) can sleep
        opt = cfg.optimizer
        model = build_model(
            cfg.model.path,
            parallel,
            dtype=cfg.model.dtype,
            distributed_optimizer=opt.use_distributed_optimizer,
            moe_options=MoEOptions(**cfg.model.moe.model_dump()),
            packed_attention=cfg.model.packed_attention,
        )
        optimizer, scheduler = make_optimizer_and_scheduler(
            model, opt, cfg.train.num_steps * cfg.train.updates_per_step
        )
        critic = Critic.build(cfg, parallel)
    for trained in [optimizer] + ([critic.optimizer] if critic else []):
        offloader.keep_optimizer_state_in_region(trained)
    roles = ModelRoles.create(cfg.algorithm, model, num_optimizer_steps=cfg.train.updates_per_step)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    sampler = None
    if parallel.is_rank0:
        dataset = PromptDataset(cfg.data, tokenizer)
        sampler = PromptSampler(dataset, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    return Components(
        cfg=cfg,
        parallel=parallel,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        roles=roles,
        critic=critic,
        engine=engine,
        offloader=offloader,
        tokenizer=tokenizer,
        sampler=sampler,
        rollout=RolloutRuntime.build(cfg, parallel, engine.client, tokenizer, sampler, group=engine),
        dp_rank_of=all_gather(parallel.dp_rank, parallel.cpu_group),
        logger=MetricsLogger(cfg) if parallel.is_rank0 else None,
    )


def train_one_step(parts: Components, state: RunState) -> None:
    timer = PhaseTimer(parts.logger)
    metrics: dict[str, float] = {}

    def mark(phase: str) -> None:  # the timeline's GPU memory queries: timed, so step_s is the step's whole wall time
        with timer("memory"):
            parts.offloader.mark(phase)

    with timer("offload"):  # here, not at the end of a step, so checkpoints between steps see an awake trainer
        parts.offloader.trainer_sleep()
        parts.offloader.engine_wake_for_rollout()
    with timer("rollout"):
        samples = rollout(parts, state.step, metrics)
    mark("rollout")
    with timer("offload"):
        parts.offloader.engine_sleep()
        parts.offloader.trainer_wake()
    with timer("scatter"):
        work = rank0_schedule(parts, samples, metrics) if parts.parallel.is_rank0 else None
        updates = [Update(mbs, tokens) for mbs, tokens in scatter_from_rank0(work, parts.parallel.cpu_group)]
    if parts.cfg.debug.rollout_only:
        updates = []  # rollout metrics only: no training and no weight sync
    micro_batches = [mb for update in updates for mb in update.micro_batches]
    if micro_batches:
        with timer("logprobs"):  # once over the whole rollout, before the first update
            metrics.update(compute_old_logprobs(parts, micro_batches, state.step))
        maybe_save_train_data(parts.cfg, state.step, parts.parallel.rank, micro_batches)
        with timer("train"):
            metrics.update(train(parts, updates, state.step))
    mark("train")
    with timer("offload"):
        parts.offloader.engine_wake_for_sync()
    if micro_batches:
        with timer("sync"):  # reads the trainer's weights: the trainer sleeps at the next step's start
            state.weight_version += 1
            sync_weights(parts, state.weight_version)
    mark("sync")
    metrics.update(parts.offloader.step_metrics())
    if parts.logger is not None:
        parts.logger.log(state.step, {**metrics, **timer.as_metrics()})


def rollout(parts: Components, step: int, metrics: dict) -> list[Sample] | None:
    """Generate and score on every rank, refilling while a dynamic filter drops groups
    (rlrun/rollout/collect.py); rank 0 returns the kept samples in prompt-major order. Evaluates
    first when ``eval.interval`` says so."""
    metrics.update(parts.rollout.evaluate_if_due(step))
    batch = parts.rollout.collect(step)
    if batch is None:
        return None
    metrics.update(batch.metrics)
    return batch.samples


def rank0_schedule(parts: Components, samples: list[Sample], metrics: dict) -> list:
    """Group scores, tied-group filtering, the split into updates, packing and DP balancing; one payload per
    global rank: a ``(micro_batches, num_global_tokens)`` pair per update."""
    cfg = parts.cfg
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
    if not kept:
        return [[]] * parts.parallel.world_size
    per_update = []  # [update][dp rank] -> micro-batches, and each update's global token count
    for part in split_into_updates(kept, cfg.rollout.samples_per_prompt, cfg.train.updates_per_rollout):
        per_dp = schedule_micro_batches(
            [s for s, _ in part],
            [a for _, a in part],
            dp_size=parts.parallel.dp_size,
            max_tokens=cfg.train.max_tokens_per_micro_batch,
            pad_token_id=parts.tokenizer.pad_token_id or 0,
        )
        per_update.append((per_dp, sum(s.num_loss_tokens for s, _ in part)))
    return [[(per_dp[dp_rank], tokens) for per_dp, tokens in per_update] for dp_rank in parts.dp_rank_of]


def split_into_updates(kept: list, group_size: int, num_updates: int) -> list[list]:
    """The kept samples (prompt-major, whole groups) in ``min(num_updates, groups)`` consecutive parts of
    whole groups, as equal in group count as possible (the first parts get the extra groups)."""
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


def compute_old_logprobs(parts: Components, micro_batches: list[MicroBatch], step: int) -> dict[str, float]:
    """Critic values, role log-probs (old policy, reference, teacher) and per-token advantages on this rank."""
    from rlrun.rl_step import logprobs_and_advantages

    return logprobs_and_advantages(parts.cfg, parts.roles, parts.parallel, micro_batches, step, parts.critic)


def train(parts: Components, updates: list[Update], step: int) -> dict[str, float]:
    """Per epoch and update: the critic's value-loss step first (PPO), then one actor step over the update's
    micro-batches with the configured RL loss (skipped during ``critic.num_critic_only_steps``); the role
    backups follow the actor after the last update."""
    from rlrun.rl_step import check_on_policy, combine_update_metrics, train_policy

    critic = parts.critic
    per_update = []
    for _ in range(parts.cfg.train.epochs_per_rollout):
        for update in updates:
            metrics = critic.train(update.micro_batches, update.num_global_tokens) if critic is not None else {}
            if critic is None or critic.actor_trains(step):
                metrics["lr"] = parts.scheduler.get_lr(parts.optimizer.param_groups[0])  # the LR of this update
                metrics.update(
                    train_policy(
                        parts.cfg,
                        parts.roles,
                        parts.parallel,
                        parts.model,
                        parts.optimizer,
                        update.micro_batches,
                        update.num_global_tokens,
                    )
                )
                parts.scheduler.step(1)
            per_update.append(metrics)
    if critic is None or critic.actor_trains(step):
        parts.roles.after_train_step(step)
        # The gate reads the first update: later ones have moved the weights off the old policy on purpose.
        check_on_policy(parts.cfg.algorithm.max_logprob_gap, step, per_update[0])
    return combine_update_metrics(per_update, len(updates))


def sync_weights(parts: Components, version: int) -> None:
    """Push the trainer's weights to this rank's engine as HF-named flattened buckets (its group's
    leader does; the other ranks of an engine group only take part in the export's collectives)."""
    from rlrun.megatron import export_hf_weights

    parts.engine.update_weights(
        export_hf_weights(parts.model),
        weight_version=str(version),
        bucket_bytes=parts.cfg.engine.bucket_bytes,
        verify=parts.cfg.engine.verify_weights,
    )
