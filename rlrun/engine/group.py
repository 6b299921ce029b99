"""Engine groups: ``engine.tp`` consecutive local ranks share one rollout engine.

    node with 4 ranks, engine.tp=2:   rank 0 (leader) ──ZMQ──> engine A (SGLang TP ranks on GPUs 0,1)
                                      rank 1 (member)  ─┘ prompts/samples over the group's gloo group
                                      rank 2 (leader) ──ZMQ──> engine B (GPUs 2,3)
                                      rank 3 (member)  ─┘

Only the **leader** (the group's first rank) spawns and talks to an engine; release/resume and
shutdown are leader-only calls that the other ranks skip. What each role does:

* **rollout** (:meth:`EngineGroup.run_on_leader`): every rank keeps its share of prompts as rank 0
  assigned them; the members hand theirs to the leader over the group's gloo group, the leader
  generates the group's prompts in one engine call and hands every rank back the samples of its own
  prompts. Every sample is produced once and returns to the rank that owns its prompt, so what rank 0
  gathers (and trains on) is laid out as with one engine per rank. A failure on the leader (a dead
  engine, a timeout) is sent to the members, so the whole group raises within the RPC's detection time.
* **weight sync** (:meth:`EngineGroup.update_weights`): every rank iterates ``export_hf_weights``
  (its all-gathers and broadcasts are collectives), but only the leader sends. ``export_hf_weights``
  already yields the whole model as *full* HF tensors on every rank (TP shards all-gathered, pipeline
  stages broadcast, DP replicas identical), so the leader holds everything its engine needs without
  a second gather. SGLang's ``update_weights_from_tensor`` takes one payload per
  engine TP rank (rank r unpickles only entry r, and every rank loads full tensors and shards them
  itself). As in slime, payload r is built by group rank r from its own copy of the bucket, on its
  own GPU, which is the GPU of engine TP rank r, and gathered to the leader over the gloo group. A
  payload over the leader's buffer for every TP rank (one flat copy instead of ``engine.tp``) does not
  work: SGLang's TP rank 1 gets ``CUDA error: invalid argument`` copying from the IPC handle of GPU 0's
  memory (BENCHMARKS.md, "Multi-GPU"). On CPU the payloads
  are shared-memory descriptors fetched from each member's resource sharer, so the members take the
  leader's multiprocessing ``authkey`` (which the engine worker is given) when the group forms.
* **backends** (``BackendTraits.shards_over_tp``): ``sglang`` gets ``tp_size=engine.tp`` and
  ``base_gpu_id`` = the leader's local rank, so its TP ranks sit on exactly the group's GPUs. The
  ``embedded`` engine is not sharded: one engine
  on the leader's device serves the whole group (tp_size 1, one payload per bucket from the leader).

A dead engine is noticed by the leader's watchdog (rlrun/runtime/watchdog.py), which ends every rank;
with ``engine.max_restarts`` > 0 the group tolerates it instead (``tolerate_loss``): an engine that dies or
stops answering during a rollout, a memory release/resume or an unsharded weight sync is recorded in
``lost`` (on the leader; a rollout tells the members too), a rollout returns :class:`EngineLost` for the
group's prompts, a sync drains the rest of the export (its collectives still run with the peers), and
every later engine call of the group is skipped (a rollout answers ``EngineLost`` at once) until the loop
has the group :meth:`~EngineGroup.restart` (rlrun/trainer/recovery.py, which asks every rank). A sharded
group (SGLang, tp > 1) whose leader dies mid-sync still fails: its
members wait for the leader's next payload gather, which would never come.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlrun.engine.client import EngineClient
from rlrun.engine.payload import iter_buckets, serialize_flattened_bucket
from rlrun.engine.registry import BackendSpec
from rlrun.engine.rpc import RpcPeerDiedError, RpcTimeoutError
from rlrun.runtime.deaths import WatchedProcess

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class EngineGroupError(RuntimeError):
    """The group's leader failed while serving the group; raised on the other ranks of the group."""


@dataclass(frozen=True)
class GroupLayout:
    """Where one rank sits among the engine groups of the job.

    Global ranks of one node are consecutive (torchrun), and a group never spans two nodes, so the
    group of ``rank`` is ``range(leader, leader + tp)`` and its GPUs are local ranks
    ``local_leader .. local_leader + tp - 1``.
    """

    tp: int
    rank: int
    world_size: int
    leader: int
    """Global rank of the group's leader (its first rank)."""
    local_leader: int
    """The leader's LOCAL_RANK: the engine's ``base_gpu_id``."""
    rank_offset: int = 0
    """Added to the ranks above to name torchrun ranks in messages: 0, except on the engine ranks of a
    disaggregated job, whose process groups number them from 0 (rlrun/rollout/engine_rank.py)."""

    @classmethod
    def of(cls, tp: int, rank: int, local_rank: int, world_size: int, local_world_size: int) -> GroupLayout:
        if tp < 1:
            raise ValueError(f"engine.tp ({tp}) must be >= 1 because it counts the ranks of an engine group")
        if local_world_size % tp:
            raise ValueError(
                f"engine.tp ({tp}) must divide the ranks per node ({local_world_size}) because an "
                "engine group's ranks share one host's GPUs; set engine.tp to a divisor of "
                "--nproc-per-node"
            )
        if world_size % tp:
            raise ValueError(
                f"engine.tp ({tp}) must divide the world size ({world_size}) because every rank "
                "belongs to exactly one engine group; give every node the same number of ranks"
            )
        offset = local_rank % tp
        return cls(tp=tp, rank=rank, world_size=world_size, leader=rank - offset, local_leader=local_rank - offset)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def all_groups(self) -> list[list[int]]:
        """Every group's global ranks, in rank order (each rank must create every group's process group)."""
        return [list(range(start, start + self.tp)) for start in range(0, self.world_size, self.tp)]


@dataclass(frozen=True)
class LeaderFailure:
    """What the leader sends its members instead of results when it failed."""

    message: str
    lost: bool = False
    """The leader's engine was lost (died or stopped answering) and the group tolerates it."""


@dataclass(frozen=True)
class EngineLost:
    """What a rollout call returns instead of samples when the group's engine is lost (``EngineGroup.lost``)."""

    message: str


def is_engine_loss(exc: BaseException) -> bool:
    """Whether ``exc`` means the engine is gone (exited, stopped, or silent past a timeout), as opposed to
    an engine that answered with an error (a bad request, a refused operation), which restarting would not fix."""
    return isinstance(exc, (RpcPeerDiedError, RpcTimeoutError))


class EngineGroup:
    """This rank's view of its engine group: the engine client (leader only) and the group's gloo group."""

    layout: GroupLayout
    client: EngineClient | None
    """The engine's client on the leader; None on the other ranks."""
    process_group: dist.ProcessGroup | None
    """Gloo group of the group's ranks; None when ``tp == 1`` (nothing to forward)."""

    sharded: bool
    """The engine's TP ranks sit on the group's GPUs (a backend that shards over TP, tp > 1): every rank
    builds its TP rank's payload."""
    tolerate_loss: bool
    """Record a lost engine in ``lost`` instead of raising (``engine.max_restarts`` > 0)."""

    lost: str | None
    """Why the group's engine was lost (one line, with the phase), the same on every rank of the group;
    None while it works. Cleared by :meth:`restart`."""

    def __init__(
        self,
        layout: GroupLayout,
        client: EngineClient | None,
        process_group: dist.ProcessGroup | None,
        sharded: bool = False,
        tolerate_loss: bool = False,
        spawn_engine: Callable[[], EngineClient] | None = None,
    ):
        self.layout = layout
        self.client = client
        self.process_group = process_group
        self.sharded = sharded
        self.tolerate_loss = tolerate_loss
        self.lost = None
        self._spawn_engine = spawn_engine

    @classmethod
    def spawn(
        cls, layout: GroupLayout, spec: BackendSpec, tolerate_loss: bool = False, **spawn_kwargs: Any
    ) -> EngineGroup:
        """Form every group's process group (collective: all ranks call this), then start the engine
        on each leader with ``EngineClient.spawn(spec, **spawn_kwargs)``, on the group's GPUs (``spec``'s
        ``tp_size`` and ``base_gpu_id`` are the layout's). A leader that fails to start its engine
        raises, and so do its members."""
        process_group = None
        if layout.tp > 1:
            for ranks in layout.all_groups():
                created = dist.new_group(ranks, backend="gloo")
                if layout.rank in ranks:
                    process_group = created
            authkey = [bytes(multiprocessing.current_process().authkey)]
            dist.broadcast_object_list(authkey, group=process_group, group_src=0)
            multiprocessing.current_process().authkey = authkey[0]
        sharded = spec.traits.shards_over_tp and layout.tp > 1
        spec = dataclasses.replace(spec, tp_size=layout.tp if sharded else 1, base_gpu_id=layout.local_leader)

        def spawn_engine() -> EngineClient:
            return EngineClient.spawn(spec, **spawn_kwargs)

        group = cls(
            layout, None, process_group, sharded=sharded, tolerate_loss=tolerate_loss, spawn_engine=spawn_engine
        )
        group.client = group._on_leader(spawn_engine)
        return group

    def restart(self) -> None:
        """Collective over the group: the leader replaces its lost engine with a fresh one (with the model's
        initial weights: the caller re-syncs). The old worker's process group is killed and its log kept as
        ``engine-<rank>.restart<N>.log``."""
        assert self._spawn_engine is not None, "restart() of a group built without spawn()"
        if self.client is not None:
            self.client.shutdown(graceful=False)  # lost: a stopped worker would not answer anyway
            old_log = self.client.log_path
            num_old = len(list(old_log.parent.glob(f"{old_log.stem}.restart*.log")))
            old_log.rename(old_log.with_name(f"{old_log.stem}.restart{num_old + 1}.log"))
        self.client = self._on_leader(self._spawn_engine)
        self.lost = None

    # ---- what the loop calls on every rank --------------------------------------------------------

    @property
    def process(self) -> subprocess.Popen | None:
        """The engine worker's process on the leader, None elsewhere."""
        return self.client.process if self.client is not None else None

    @property
    def watched(self) -> WatchedProcess | None:
        """The engine worker as the watchdog watches it, on the leader; None elsewhere."""
        return self.client.watched if self.client is not None else None

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._on_engine("offload", lambda engine: engine.release_memory_occupation(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._on_engine("offload", lambda engine: engine.resume_memory_occupation(tags))

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, **kwargs: Any
    ) -> dict | None:
        """The leader pushes the full tensors (``EngineClient.update_weights``, one payload per engine
        TP rank). The other ranks iterate the export too, whose collectives (TP all-gathers, PP
        broadcasts) their peers wait on; in a sharded group they also bucket it alike and hand the
        leader their TP rank's payload of each bucket, and wait until the leader's session is over."""
        if not self.sharded:
            named_tensors = iter(named_tensors)
            if self.client is not None and self.lost is None:
                try:
                    return self.client.update_weights(named_tensors, bucket_bytes=bucket_bytes, **kwargs)
                except Exception as exc:
                    if not self._tolerated(exc, "sync"):
                        raise
            for _ in named_tensors:  # the export's collectives run on the peers too
                pass
            return None
        result = None
        if self.client is not None:
            result = self.client.update_weights(
                named_tensors, bucket_bytes=bucket_bytes, serialize=self._gather_payloads, **kwargs
            )
        else:
            for bucket in iter_buckets(named_tensors, bucket_bytes):
                self._gather_payloads(bucket)
        dist.barrier(group=self.process_group)  # the members' buffers stay until the engine has loaded them
        return result

    def run_on_leader(
        self, items: list[T], fn: Callable[[list[T]], list[R]], outputs_per_item: int
    ) -> list[R] | EngineLost:
        """Every rank passes its ``items``; the leader calls ``fn`` once on the group's items (in rank
        order), which must return ``outputs_per_item`` outputs per item, item-major; every rank gets the
        outputs of its own items back, or :class:`EngineLost` on every rank when a tolerated loss happened
        in ``fn`` or before (``lost``)."""
        if self.process_group is None:
            return self.call_alone(lambda: fn(items))
        # The members always take part: only the leader may know of a loss (one in a leader-only call).
        gathered: list[Any] | None = [None] * self.layout.tp if self.layout.is_leader else None
        dist.gather_object(items, gathered, group=self.process_group, group_dst=0)
        failure: BaseException | None = None
        per_rank: list[Any] | None = None
        if gathered is not None and self.lost is not None:
            per_rank = [LeaderFailure(self.lost, lost=True)] * self.layout.tp
        elif gathered is not None:  # the leader
            try:
                per_rank = _split(
                    fn([x for part in gathered for x in part]), [len(p) for p in gathered], outputs_per_item
                )
            except Exception as exc:  # noqa: BLE001 - sent to the members below, then re-raised here
                lost = self._tolerated(exc, "rollout")
                failure = None if lost else exc
                message = self.lost if lost else f"{type(exc).__name__}: {exc}"
                per_rank = [LeaderFailure(message or "", lost=lost)] * self.layout.tp
        received: list[Any] = [None]
        dist.scatter_object_list(received, per_rank, group=self.process_group, group_src=0)
        if failure is not None:
            raise failure
        if isinstance(received[0], LeaderFailure) and received[0].lost:
            self.lost = received[0].message
            return EngineLost(self.lost)
        return self._unless_failed(received[0])

    def call_alone(self, fn: Callable[[], R]) -> R | EngineLost:
        """The leader, without its members (an engine rank's leader serves rank 0's generate messages alone):
        ``fn()``, or :class:`EngineLost` when a tolerated loss happened in it or before (``lost``)."""
        if self.lost is not None:
            return EngineLost(self.lost)
        try:
            return fn()
        except Exception as exc:
            if not self._tolerated(exc, "rollout"):
                raise
            return EngineLost(self.lost or "")

    def engine_ranks(self, leaders: list[int]) -> list[int]:
        """The torchrun ranks that host the engines of the groups led by ``leaders``: those leaders (the name a
        restart's log line gives; ``RemoteEngines`` names its engine ranks)."""
        return [self.layout.rank_offset + leader for leader in leaders]

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.shutdown(graceful=self.lost is None)

    # ---- internals --------------------------------------------------------------------------------

    def _on_engine(self, phase: str, call: Callable[[EngineClient], None]) -> None:
        """A leader-only call (the members skip it), skipped while the engine is lost."""
        if self.client is None or self.lost is not None:
            return
        try:
            call(self.client)
        except Exception as exc:
            if not self._tolerated(exc, phase):
                raise

    def _tolerated(self, exc: BaseException, phase: str) -> bool:
        """Record ``exc`` as the loss of this group's engine in ``phase`` if the group tolerates it."""
        if not (self.tolerate_loss and is_engine_loss(exc)):
            return False
        first_line = (str(exc).strip().splitlines() or [""])[0]
        leader = self.layout.rank_offset + self.layout.leader
        self.lost = f"engine of rank {leader} lost in {phase}: {type(exc).__name__}: {first_line}"
        log.warning("%s\n%s", self.lost, exc)
        return True

    def _gather_payloads(self, bucket: list[tuple[str, torch.Tensor]]) -> list[bytes]:
        """This rank's payload of ``bucket`` (its own device's buffer); the leader gets all, in rank order
        (the members an empty list)."""
        gathered: list[Any] | None = [None] * self.layout.tp if self.layout.is_leader else None
        dist.gather_object(serialize_flattened_bucket(bucket), gathered, group=self.process_group, group_dst=0)
        return gathered if gathered is not None else []

    def _on_leader(self, fn: Callable[[], R]) -> R | None:
        """Run ``fn`` on the leader and let the members know whether it worked (they get None)."""
        result: R | None = None
        outcome: list[LeaderFailure | None] = [None]
        if self.layout.is_leader:
            try:
                result = fn()
            except Exception as exc:
                outcome = [LeaderFailure(f"{type(exc).__name__}: {exc}")]
                if self.process_group is not None:
                    dist.broadcast_object_list(outcome, group=self.process_group, group_src=0)
                raise
        if self.process_group is not None:
            dist.broadcast_object_list(outcome, group=self.process_group, group_src=0)
        self._unless_failed(outcome[0])
        return result

    def _unless_failed(self, received: Any) -> Any:
        if isinstance(received, LeaderFailure):
            raise EngineGroupError(
                f"engine group leader rank {self.layout.rank_offset + self.layout.leader} failed while serving "
                f"rank {self.layout.rank_offset + self.layout.rank}: {received.message}"
            )
        return received


def _split(outputs: list[R], counts: list[int], outputs_per_item: int) -> list[list[R]]:
    """Cut item-major ``outputs`` back into one list per rank (``counts[i]`` items of rank i)."""
    if len(outputs) != sum(counts) * outputs_per_item:
        raise RuntimeError(
            f"the engine group leader got {len(outputs)} outputs for {sum(counts)} items x "
            f"{outputs_per_item}; the rollout must return whole groups, item-major"
        )
    per_rank, start = [], 0
    for count in counts:
        end = start + count * outputs_per_item
        per_rank.append(outputs[start:end])
        start = end
    return per_rank
