"""An engine rank of a disaggregated job (``placement.engine_ranks``; docs/async.md): one engine, no trainer.

    training rank 0 ──control: ("generate", [(prompts, seed), ...], (step, round))──> engine rank e
                    <──────────── generated, scored samples ──────────────
                    ──control: ("weights", version, ...) + weights: bucket broadcast──> every engine rank
                    <──────────── "loaded" ───────────────────────────────
                    ──control: ("restart",)──> (engine.max_restarts: a fresh worker; weights follow)
                    <──────────── "restarted" ────────────────────────────
                    ──control: ("stop",)──> (the worker is shut down, the rank exits)

The rank serves rank 0's messages in order until ``stop``: it generates and scores each share of a round (the
prompts of one colocated rank it stands in for, with that rank's seed) exactly as that rank's
``RolloutRuntime.generate_and_score`` does (the same hooks, rewards and seeds), and loads weights by the
colocated handover (``EngineGroup.update_weights``). A failure is reported to rank 0 as its reply and ends the
job through the watchdog, which also watches this rank and, without ``engine.max_restarts``, its engine worker.

With ``engine.max_restarts`` the rank's ``EngineGroup`` tolerates the loss of its worker as a colocated rank's
does: the reply to that generate or weights message is ``EngineLost``, and the loop's recovery on the training
ranks (rlrun/trainer/recovery.py) has rank 0 send ``restart``, then the current weights, and redo the step's
rollout. The rank process itself is not restarted: its death ends the torchrun job (``checkpoint.resume`` brings
it back).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlrun.config.schema import RunConfig
from rlrun.engine.group import EngineGroup, EngineLost, GroupLayout
from rlrun.rollout.collect import RolloutRuntime
from rlrun.runtime.dist import DistEnv, Parallel
from rlrun.runtime.placement import Link, all_ranks_started, num_training_ranks

log = logging.getLogger(__name__)


def engine_rank_parallel(env: DistEnv, engine_ranks: int) -> Parallel:
    """This rank's place for the watchdog and the rollout code: engine rank ``e`` of ``engine_ranks``, outside
    every process group but the link (``cpu_group`` None: nothing here may run a collective on it)."""
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
        link = Link.open(env, n)
        with stop.held():  # the engine worker inherits the blocked signals (rlrun/runtime/preemption.py)
            layout = GroupLayout.of(1, env.rank, env.local_rank, env.world_size, env.local_world_size)
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
        # group=engine: a generate call goes through EngineGroup.run_on_leader, which answers EngineLost for a
        # tolerated loss (engine.max_restarts) as on a colocated rank
        runtime = RolloutRuntime.build(cfg, parallel, engine.client, tokenizer, sampler=None, group=engine)
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
                reply = _generate(runtime, watchdog, *args)
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


def _generate(runtime: RolloutRuntime, watchdog, shares: list, round_at: tuple[int, int]) -> list | EngineLost:
    """The samples of every share, one call per share as the colocated rank it belongs to makes it (the same
    seed, the same samples); ``EngineLost`` once the worker is lost (``engine.max_restarts``)."""
    watchdog.step, watchdog.phase = round_at[0], "rollout"
    samples = []
    for prompts, seed in shares:
        share = runtime.generate_and_score(prompts, seed, round_at=round_at)
        if isinstance(share, EngineLost):
            return share
        samples += share
    return samples
