"""What one rank holds for the whole run (``Components``, built once by :func:`setup`), and the two pieces of the
step that both loops call: the train batch's scatter and the sync schedule (rlrun/trainer/loop.py for the
synchronous step, rlrun/trainer/ahead_step.py for the one that trains while the next rollout generates).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch.distributed as dist

from rlrun.config.load import dump_config
from rlrun.config.schema import RunConfig
from rlrun.data.sample import Sample
from rlrun.data.source import PromptSource
from rlrun.data.transfer import all_gather, scatter_from_rank0
from rlrun.engine.group import EngineGroup
from rlrun.observability.metrics import MetricsLogger
from rlrun.rollout.collect import RolloutRuntime
from rlrun.runtime.dist import Parallel
from rlrun.trainer.actor import Actor
from rlrun.trainer.batch import BatchPlanner, TrainBatch
from rlrun.trainer.offload import Offloader
from rlrun.trainer.recovery import EngineRecovery

if TYPE_CHECKING:
    from rlrun.runtime.watchdog import Watchdog


@dataclass
class Components:
    """What one rank holds for the whole run (built once by :func:`setup`): the run's settings and place,
    the engine and the memory turn-taking around it, the trainer, the rollout side, rank 0's parts."""

    cfg: RunConfig
    parallel: Parallel
    engine: EngineGroup  # rlrun.trainer.placement.RemoteEngines with placement.engine_ranks
    offloader: Offloader
    recovery: EngineRecovery  # restarts lost engines (engine.max_restarts)
    actor: Actor
    rollout: RolloutRuntime  # engine calls, rewards, rollout hooks, the dynamic filter, evaluation
    planner: BatchPlanner  # rank 0 plans every rank's TrainBatch
    sampler: PromptSource | None  # rank 0 only: data.sampler's source, by default the seeded PromptSampler
    logger: MetricsLogger | None  # rank 0 only
    watchdog: Watchdog  # told each phase, so a failure it reports names where this rank was


def setup(cfg: RunConfig, parallel: Parallel, watchdog: Watchdog) -> Components:
    """Collective: save the resolved config, start the engine (before Megatron allocates; with
    ``placement.engine_ranks``, connect rank 0 to the engine ranks instead), build the trainer, the data source
    (rank 0), the optional teacher engine and the rollout side."""
    from transformers import AutoTokenizer

    from rlrun.engine.group import GroupLayout
    from rlrun.engine.registry import BackendSpec

    run_dir = Path(cfg.logging.run_dir)
    if parallel.is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    dist.barrier(group=parallel.cpu_group)
    runtime_cls: type[RolloutRuntime] = RolloutRuntime
    if cfg.placement.engine_ranks:  # the engines are ranks of their own (rlrun/trainer/placement.py)
        from rlrun.trainer.placement import RemoteEngines, RemoteRollout

        # RemoteEngines stands in for EngineGroup: it answers every call the loop, offloader and recovery make.
        engine, runtime_cls = cast(EngineGroup, RemoteEngines.connect(cfg, parallel)), RemoteRollout
    else:
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
            tolerate_loss=cfg.engine.max_restarts > 0,
        )
    offloader = Offloader(cfg.offload, engine, parallel.device)
    recovery = EngineRecovery(cfg.engine.max_restarts, cfg.engine.startup_timeout_s, engine, offloader, parallel)
    actor = Actor.build(cfg, parallel, offloader)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    sampler = None
    if parallel.is_rank0:
        from rlrun.data.prompts import PromptDataset
        from rlrun.data.source import build_source

        sampler = build_source(cfg.data, PromptDataset(cfg.data, tokenizer), seed=cfg.train.seed)
    teacher = None
    if cfg.algorithm.opd.teacher_engine is not None:
        from rlrun.rollout.teacher import TeacherEngine, check_teacher_tokenizer

        check_teacher_tokenizer(cfg, tokenizer, parallel)
        teacher = TeacherEngine.spawn(cfg, parallel.rank, run_dir)
    rollout = runtime_cls.build(cfg, parallel, engine.client, tokenizer, sampler, group=engine, teacher=teacher)
    dp_rank_of = all_gather(parallel.dp_rank, parallel.cpu_group)
    return Components(
        cfg=cfg,
        parallel=parallel,
        engine=engine,
        offloader=offloader,
        recovery=recovery,
        actor=actor,
        rollout=rollout,
        planner=BatchPlanner(
            cfg,
            dp_rank_of,
            parallel.dp_size,
            pad_token_id=tokenizer.pad_token_id or 0,
            sample_to_train=rollout.hooks.sample_to_train,
        ),
        sampler=sampler,
        logger=MetricsLogger(cfg) if parallel.is_rank0 else None,
        watchdog=watchdog,
    )


def sync_due(interval: int, step: int, trained: bool) -> bool:
    """Whether step ``step`` ends with a weight sync: after every ``interval``-th step; with interval 1 only
    when the step trained (the engine already holds the weights otherwise). With a larger interval the sync
    is due even after a step that trained nothing, since earlier steps since the last sync may have."""
    return (step + 1) % interval == 0 and (trained or interval > 1)


def scatter_train_batch(parts: Components, samples: list[Sample] | None, metrics: dict[str, float]) -> TrainBatch:
    """Rank 0 plans every rank's ``TrainBatch`` (adding the rollout's metrics) and scatters them; with
    ``debug.rollout_only`` nothing trains (rollout metrics only, no weight sync)."""
    plan = parts.planner.plan(samples, metrics) if samples is not None else None
    batch: TrainBatch = scatter_from_rank0(plan, parts.parallel.cpu_group)
    return TrainBatch([]) if parts.cfg.debug.rollout_only else batch
