"""The training ranks' side of disaggregated placement (``placement.engine_ranks``; docs/async.md).

The training ranks have no engine. Two stand-ins take the colocated ones' places in ``Components``, so the
loop (rlrun/trainer/loop.py) and the loop that generates ahead (rlrun/trainer/ahead_step.py) run unchanged:

* :class:`RemoteEngines` for ``EngineGroup``: rank 0 broadcasts the exported weights to every engine rank
  (rlrun/runtime/placement.py); the other training ranks only take part in the export's collectives. With
  ``engine.max_restarts`` it also answers the loop's recovery (rlrun/trainer/recovery.py): an engine group
  whose worker was lost says so in its leader's reply, rank 0 reports it as its own ``lost``, and the
  recovery's restart and re-sync become a ``restart`` message to the group and a broadcast of the current
  weights.
* :class:`RemoteRollout` for ``RolloutRuntime``: rank 0 draws each sampling round's prompts, splits them into
  the shares of the colocated ranks the engine ranks stand in for, and gathers their generated, scored
  samples; the other training ranks wait for the train batch's scatter.

A round has one share per training rank (one per engine rank if there are more engine ranks), each with the
sampling seed that colocated rank would use. As in colocated engine groups, ``engine.tp`` consecutive shares
make one engine call with the seed of the first (its group leader's); engine group ``g`` (engine ranks
``g * tp`` on) serves a contiguous run of these calls (:func:`engine_of`). The samples are therefore the ones
colocated ranks with the same ``engine.tp`` would draw, and with ``max_staleness`` 0 N training ranks and
M <= N engine ranks train exactly what N colocated ranks with that ``engine.tp`` train
(tests/integration/test_disaggregated.py).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import torch

from rlrun.config.schema import RunConfig
from rlrun.engine.group import EngineLost, GroupLayout
from rlrun.rollout.collect import RolloutRuntime
from rlrun.rollout.driver import group_samples, split_groups
from rlrun.rollout.tally import RolloutBatch
from rlrun.runtime.dist import Parallel
from rlrun.runtime.placement import Link


def engine_of(call: int, num_calls: int, num_engines: int) -> int:
    """The engine (group) that serves engine call ``call`` of a round: contiguous, near-equal runs of calls."""
    return call * num_engines // num_calls


def engine_calls(shares: list[tuple[list, int]], tp: int) -> list[tuple[list, int]]:
    """A round's ``(prompts, seed)`` per colocated rank as the engine calls of colocated engine groups of ``tp``
    ranks: each group's prompts in rank order, with its leader's seed (``EngineGroup.run_on_leader``)."""
    assert len(shares) % tp == 0, (len(shares), tp)
    return [
        ([p for prompts, _ in shares[i : i + tp] for p in prompts], shares[i][1]) for i in range(0, len(shares), tp)
    ]


class RemoteEngines:
    """``EngineGroup``'s part the loop uses, for a training rank whose engines are engine ranks."""

    client = None  # the training ranks drive no engine worker: nothing to watch or offload here
    process = None
    watched = None

    def __init__(self, link: Link | None, num_engines: int, tp: int, layout: GroupLayout) -> None:
        self.link = link
        """Rank 0's link to the engine ranks; None on the other training ranks."""
        self.num_engines = num_engines
        """Engine ranks (``placement.engine_ranks``); engine rank ``e`` is torchrun rank
        ``layout.world_size + e``."""
        self.tp = tp
        """Engine ranks per engine group (``engine.tp``); group ``g``'s leader is engine rank ``g * tp``."""
        self.layout = layout
        """A group of one per training rank: the recovery reads a loss rank 0 reports as rank 0's own."""
        self._lost: dict[int, str] = {}
        """Rank 0: engine group -> why its worker was lost (its leader's ``EngineGroup.lost``), until it
        restarts."""

    @classmethod
    def connect(cls, cfg: RunConfig, parallel: Parallel) -> RemoteEngines:
        """Rank 0 opens the link (collective with the engine ranks); the other training ranks hold none."""
        n, tp = cfg.placement.engine_ranks, cfg.engine.tp
        if max(parallel.world_size, n) % tp:
            raise ValueError(
                f"engine.tp ({tp}) must divide the number of training ranks ({parallel.world_size}) when it exceeds "
                f"placement.engine_ranks ({n}) because a round's prompts are split as that many colocated ranks "
                "with this engine.tp would split them; launch a multiple of engine.tp training ranks"
            )
        layout = GroupLayout(1, parallel.rank, parallel.world_size, leader=parallel.rank, local_leader=0)
        return cls(Link.open(parallel.env, n, parallel.device) if parallel.is_rank0 else None, n, tp, layout)

    @property
    def num_groups(self) -> int:
        return self.num_engines // self.tp

    @property
    def lost(self) -> str | None:
        """Rank 0: why the first engine group still lost was lost; None elsewhere and while every one serves. One
        group at a time, so each restart counts against ``engine.max_restarts``: another one lost is reported by
        its next reply (at once, as its ``EngineGroup`` skips calls while lost)."""
        return self._lost[min(self._lost)] if self._lost else None

    def engine_ranks(self, leaders: list[int]) -> list[int]:
        """Rank 0, for its restart's log line (the training ranks it is given report their engine groups' losses
        as rank 0's own): the torchrun rank of the engine group :attr:`lost` names, the one :meth:`restart`
        restarts."""
        return [self.layout.world_size + min(self._lost) * self.tp] if self._lost else []

    def restart(self) -> None:
        """Rank 0 (the recovery calls it where :attr:`lost`): that engine group starts a fresh worker, with the
        model's initial weights (the recovery's re-sync follows, to every engine rank)."""
        if self.link is None or not self._lost:
            return
        g = min(self._lost)
        members = range(1 + g * self.tp, 1 + (g + 1) * self.tp)  # EngineGroup.restart is collective over them
        for dst in members:
            self.link.send(("restart",), dst)
        for dst in members:
            reply = self.link.recv(dst)
            if reply != "restarted":
                raise RuntimeError(f"engine rank {dst - 1} failed to restart its engine worker: {reply}")
        del self._lost[g]

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        weight_version: str,
        verify: bool = False,
    ) -> None:
        """Rank 0: every engine rank loads the full tensors (its ``EngineGroup.update_weights``); every training
        rank iterates the export to its end, whose collectives its peers wait on."""
        if self.link is None:
            for _ in named_tensors:
                pass
            return
        for dst in range(1, self.link.size):
            self.link.send(("weights", weight_version, bucket_bytes, verify), dst)
        self.link.send_weights(named_tensors, bucket_bytes)
        for dst in range(1, self.link.size):  # loaded everywhere before the next rollout may start
            reply = self.link.recv(dst)
            if isinstance(reply, EngineLost):  # only with engine.max_restarts: the recovery restarts it
                self._lost[(dst - 1) // self.tp] = reply.message
            elif reply != "loaded":
                raise RuntimeError(f"engine rank {dst - 1} failed to load weight version {weight_version}: {reply}")

    def generate(self, shares: list[tuple[list, int]], round_at: tuple[int, int]) -> list:
        """Rank 0: each engine group's samples (scored there) of its engine calls (:func:`engine_calls` of a
        round's ``(prompts, seed)`` per colocated rank; :func:`engine_of` assigns them), in group order, from
        its leader; :class:`EngineLost` from a group whose worker was lost (``engine.max_restarts``)."""
        assert self.link is not None, "generate() on a training rank other than 0"
        calls = engine_calls(shares, self.tp)
        leaders = [1 + g * self.tp for g in range(self.num_groups)]
        for g, leader in enumerate(leaders):
            mine = [call for c, call in enumerate(calls) if engine_of(c, len(calls), self.num_groups) == g]
            self.link.send(("generate", mine, round_at), leader)
        replies = [self.link.recv(leader) for leader in leaders]
        for g, reply in enumerate(replies):
            if isinstance(reply, str):
                raise RuntimeError(
                    f"engine rank {g * self.tp} failed in step {round_at[0]}'s round {round_at[1]}: {reply}"
                )
            if isinstance(reply, EngineLost):  # only with engine.max_restarts: the recovery restarts it
                self._lost[g] = reply.message
        return replies

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        raise AssertionError("offload is refused with placement.engine_ranks (config validation)")

    resume_memory_occupation = release_memory_occupation

    def shutdown(self) -> None:
        """Rank 0: tell every engine rank to stop (its engine worker ends with it)."""
        if self.link is not None:
            for dst in range(1, self.link.size):
                self.link.send(("stop",), dst)
            self.link = None


class RemoteRollout(RolloutRuntime):
    """``RolloutRuntime`` whose sampling rounds generate on the engine ranks (``group`` is the
    :class:`RemoteEngines`). Loaded batches, saved batches and the reward post-process run as colocated."""

    def _sample_rounds(self, step: int) -> RolloutBatch | None:
        """Rank 0: rounds until the batch is full, as ``RolloutRuntime._sample_rounds`` with the engine ranks in
        the colocated ranks' places; None on the other training ranks (they take no part)."""
        if not self.parallel.is_rank0:
            return None
        engines: RemoteEngines = self.group
        r, tally = self.cfg.rollout, self._new_tally()
        assert tally is not None
        assert self.sampler is not None  # rank 0 holds the prompt source
        for round_index in itertools.count():
            if len(tally.kept) >= tally.target or tally.rounds >= r.max_sampling_rounds or tally.engine_lost:
                break
            prompts = self.sampler.next_batch(r.prompts_per_round)
            tally.prompts_drawn += len(prompts)
            # colocated rank s's share and seed (RolloutRuntime._sample_rounds), whichever engine rank serves it
            num_shares = max(self.parallel.world_size, engines.num_engines)
            seeds = [self.round_seed(step, s, round_index) for s in range(num_shares)]
            shares = list(zip(split_groups(prompts, num_shares), seeds, strict=True))
            parts: list[Any] = engines.generate(shares, (step, round_index))
            tally.engine_lost = any(isinstance(part, EngineLost) for part in parts)  # the loop redoes the step
            kept = [s for part in parts if not isinstance(part, EngineLost) for s in part]
            tally.add_round(group_samples(kept, r.samples_per_prompt), self.hooks.dynamic_filter)
        return tally.batch()
