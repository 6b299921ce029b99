"""An engine rank of a disaggregated job (``placement.engine_ranks``; docs/async.md): engines, no trainer.

The engine ranks form engine groups of ``engine.tp`` consecutive ranks, as colocated ranks do
(rlrun/engine/group.py, in the engine ranks' own default process group): one engine per group, driven by the
group's first rank, its leader.

    training rank 0 ──control: ("generate", [(prompts, seed), ...], (step, round))──> each group's leader
                    <──────────── generated, scored samples ──────────────
                    ──control: ("weights", version, ...) + weights: bucket broadcast──> every engine rank
                    <──────────── "loaded" ───────────────────────────────
                    ──control: ("restart",)──> every rank of a group (engine.max_restarts: a fresh worker)
                    <──────────── "restarted" ────────────────────────────
                    ──control: ("stop",)──> every engine rank (the worker is shut down, the rank exits)

The rank serves rank 0's messages in order until ``stop``. A leader generates and scores each call of a round
(the prompts of one colocated engine group it stands in for, with that group's leader's seed) exactly as that
group's ``RolloutRuntime.generate_and_score`` does (the same hooks, rewards and seeds). Every rank of a group
takes the broadcast weights and loads them by the colocated handover (``EngineGroup.update_weights``: the
leader pushes, and with an engine sharded over ``engine.tp`` every rank builds its TP rank's payload). A failure
is reported to rank 0 as its reply and ends the job through the watchdog, which also watches this rank and,
without ``engine.max_restarts``, its engine worker.

With ``engine.max_restarts`` the group's ``EngineGroup`` tolerates the loss of its worker as a colocated group's
does: the leader's reply to that generate or weights message is ``EngineLost``, and the loop's recovery on the
training ranks (rlrun/trainer/recovery.py) has rank 0 send the group ``restart``, then the current weights, and
redo the step's rollout. The rank process itself is not restarted: its death ends the torchrun job
(``checkpoint.resume`` brings it back).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from rlrun.config.schema import RunConfig
from rlrun.engine.group import EngineGroup, EngineLost, GroupLayout
from rlrun.rollout.collect import RolloutRuntime
from rlrun.runtime.dist import DistEnv, Parallel
from rlrun.runtime.placement import Link, all_ranks_started, join_engine_world, num_training_ranks

log = logging.getLogger(__name__)


def engine_rank_parallel(env: DistEnv, engine_ranks: int) -> Parallel:
    """This rank's place for the watchdog and the rollout code: engine rank ``e`` of ``engine_ranks``, outside
    the training ranks' process groups (``cpu_group`` None: nothing here may run a collective on it; the engine
    groups have the engine ranks' own, :func:`rlrun.runtime.placement.join_engine_world`)."""
    device = torch.device("cuda", env.local_rank) if torch.cuda.is_available() else torch.device("cpu")
    e = env.rank - num_training_ranks(env, engine_ranks)
    return Parallel(
        rank=env.rank,
        world_size=env.world_size,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        dp_rank=e,
        dp_size=engine_ranks,
        device=device,
        cpu_group=None,
        env=env,  # type: ignore[arg-type]
    )


def engine_layout(env: DistEnv, engine_ranks: int, tp: int) -> GroupLayout:
    """Engine rank ``e``'s engine group: engine ranks ``e - e % tp`` on, numbered as in the engine ranks' default
    process group, whose GPUs (local ranks) must sit on one host."""
    first_engine = num_training_ranks(env, engine_ranks)
    e = env.rank - first_engine
    offset = e % tp
    local_leader = env.local_rank - offset
    if local_leader < 0 or local_leader + tp > env.local_world_size:
        leader = first_engine + e - offset
        raise ValueError(
            f"engine.tp ({tp}) groups torchrun ranks {leader}..{leader + tp - 1} into one engine, which would "
            f"span two hosts because the engine ranks start at rank {first_engine}; launch a number of ranks per "
            "host that puts a multiple of engine.tp engine ranks on each host, or lower engine.tp"
        )
    return GroupLayout(tp, e, engine_ranks, leader=e - offset, local_leader=local_leader, rank_offset=first_engine)


def serve(cfg: RunConfig) -> bool:
    """The engine rank's whole run; returns False (no hard exit needed, as ``rlrun.trainer.loop.run``'s)."""
    from transformers import AutoTokenizer

    from rlrun.engine.registry import BackendSpec
    from rlrun.runtime.preemption import StopRequest
    from rlrun.runtime.watchdog import Watchdog

    env, n = DistEnv.from_env(), cfg.placement.engine_ranks
    parallel = engine_rank_parallel(env, n)
    e = parallel.dp_rank
    all_ranks_started(env)
    # SIGTERM means "checkpoint and stop" to the trainers; this rank stops when rank 0 says so, after it.
    stop, watchdog, engine = StopRequest.install(), Watchdog.start(parallel, role="engine rank"), None
    try:
        link = Link.open(env, n, parallel.device)
        layout = engine_layout(env, n, cfg.engine.tp)
        join_engine_world(env, n)
        with stop.held():  # the engine worker inherits the blocked signals (rlrun/runtime/preemption.py)
            engine = EngineGroup.spawn(
                layout,
                BackendSpec.from_config(cfg, seed=cfg.train.seed + e),  # colocated rank e's engine seed
                run_dir=Path(cfg.logging.run_dir),
                rank=env.rank,
                startup_timeout_s=cfg.engine.startup_timeout_s,
                request_timeout_s=cfg.engine.request_timeout_s,
                heartbeat_timeout_s=cfg.engine.heartbeat_timeout_s,
                tolerate_loss=cfg.engine.max_restarts > 0,
            )
        if cfg.engine.max_restarts == 0:  # else a lost worker is restarted, not the end of the job
            watchdog.watch_engine(engine.watched)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        # no group: the leader generates alone, each call through EngineGroup.call_alone (_generate)
        runtime = RolloutRuntime.build(cfg, parallel, engine.client, tokenizer, sampler=None)
        _serve_messages(link, engine, runtime, watchdog, stop)
        watchdog.close(None)
    except BaseException as exc:
        watchdog.fail(exc)
        raise
    finally:
        if engine is not None:
            engine.shutdown()
    return False


def _serve_messages(link: Link, engine: EngineGroup, runtime: RolloutRuntime, watchdog, stop) -> None:
    """Rank 0's messages in order until ``stop`` (see the module docstring)."""
    while True:
        watchdog.phase = "waiting for rank 0"
        kind, *args = link.recv(0)
        if kind == "stop":
            return
        if kind == "generate":
            try:
                reply = _generate(engine, runtime, watchdog, *args)
            except Exception as exc:
                link.send(f"{type(exc).__name__}: {exc}", 0)  # rank 0 raises it, naming this rank
                raise
            link.send(reply, 0)
        elif kind == "weights":
            version, bucket_bytes, verify = args
            watchdog.phase = "sync"
            received = link.recv_weights()
            try:
                engine.update_weights(received, bucket_bytes, weight_version=version, verify=verify)
            except Exception as exc:
                link.send(f"{type(exc).__name__}: {exc}", 0)
                raise
            for _ in received:  # the broadcast runs to its end on every engine rank
                pass
            link.send("loaded" if engine.lost is None else EngineLost(engine.lost), 0)
        elif kind == "restart":
            watchdog.phase = "engine restart"
            if engine.layout.is_leader:
                log.warning(
                    "[rlrun] engine rank %d (rank %d): restarting its engine worker at step %d: %s",
                    runtime.parallel.dp_rank,
                    runtime.parallel.rank,
                    watchdog.step,
                    engine.lost,
                )
            with stop.held():  # as at the start: the new worker inherits the blocked signals
                engine.restart()
            runtime.engine = engine.client
            link.send("restarted", 0)
        else:
            raise AssertionError(f"engine rank got an unknown message {kind!r} from rank 0")


def _generate(
    engine: EngineGroup, runtime: RolloutRuntime, watchdog, calls: list, round_at: tuple[int, int]
) -> list | EngineLost:
    """A group leader: the samples of every call, each made as the leader of the colocated engine group it
    stands in for makes it (the same prompts, seed and samples); ``EngineLost`` once the worker is lost
    (``engine.max_restarts``)."""
    watchdog.step, watchdog.phase = round_at[0], "rollout"
    samples = []
    for prompts, seed in calls:
        part = engine.call_alone(functools.partial(runtime.generate_and_score, prompts, seed, round_at=round_at))
        if isinstance(part, EngineLost):
            return part
        samples += part
    return samples
