"""Process groups whose communicators can be destroyed while the trainer sleeps and rebuilt at wake.

Why: every NCCL communicator holds device memory outside torch's allocator, even for a one-rank group (BENCHMARKS.md,
"Offload: trainer and engine taking turns on one GPU"), and Megatron creates several; a sleeping trainer would keep them
resident during rollout. Only ``torch.distributed.destroy_process_group`` gives
that memory back, but Megatron's parallel_state, its DDP buckets, the optimizer and every module's
``tp_group`` / ``pg_collection`` hold the group *objects*. So each group is a :class:`ReloadableGroup`:
a ``ProcessGroup`` that forwards to a replaceable inner group. :func:`destroy_all` destroys the inner
groups, :func:`rebuild_all` re-creates them with the arguments Megatron first gave, and the objects
everyone holds stay valid.

The patches, and why each exists (the minimum Megatron 0.16.1's code paths need):

* ``torch.distributed.new_group`` (:func:`install`, before ``initialize_model_parallel``): Megatron's
  ``parallel_state.create_group`` creates every group through it, so this is the one place to hand out
  wrappers and record the arguments to replay. Every call is recorded, also those that return
  ``NON_GROUP_MEMBER`` on this rank: torch names groups by a per-process counter, so all ranks must
  replay the same calls in the same order for the new groups' names (and store prefixes) to agree.
* torch's group tables (``_world.pg_map``, ``pg_names``, ``pg_group_ranks``, ``pg_backend_config``,
  ``pg_to_tag``) get an entry for the wrapper mirroring its inner group: ``get_rank(group)``,
  ``get_process_group_ranks``, ``get_global_rank``, ``get_backend`` and ``destroy_process_group`` look
  the group up there by object. Mirroring the tables instead of wrapping those functions also covers
  code that bound them at import (Megatron's ``from torch.distributed import _coalescing_manager``).
* Collectives need no patch: torch's collective functions call the group's own methods
  (``group.allreduce``, ``group._allgather_base``, ``group._start_coalescing``, ``group.send`` ...),
  which the wrapper forwards, and object collectives and barriers read ``group._device_types``, which it
  forwards too. A collective on a destroyed group raises at once instead of hanging.
* A one-rank group answers its collectives itself (rlrun/runtime/one_rank_collectives.py: the identity or a
  copy), so it never gets a communicator and is never torn down: on one GPU every group is such, and each
  sleep would otherwise destroy and each train phase re-create their communicators, at every step.
  Only the groups of more than one rank are destroyed and rebuilt; whether a call made one is read from its
  ``ranks``, the same on every rank, so every rank still replays the same calls in the same order. A
  collective the module does not answer (a pre-multiplied sum) goes to the real group and creates its
  communicator, which then stays while the trainer sleeps: :func:`one_rank_groups_with_communicator` counts
  those groups, and the offloader reports it.

Not reloadable: the default (WORLD) group, which exists before :func:`install` and which torch resolves
``group=None`` to internally, and groups of other backends (gloo control groups stay up while the trainer
sleeps). NCCL creates WORLD's communicator lazily (rlrun's ``init_process_group`` passes no
``device_id``); traced on CPU, the one WORLD collective of model build, train steps and weight export is
the ``all_gather_object`` of Megatron's optimizer setup (megatron/core/optimizer/__init__.py:181). On an
NCCL-only default group that object collective runs on CUDA and creates the communicator (likely part of
what a trainer holds above its CUDA context before its first step); a default group of
``"cpu:gloo,cuda:nccl"`` would run it on gloo instead (:func:`backend_names` reads that form).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rlrun.runtime import one_rank_collectives

_KEPT = {"rank", "size", "shutdown", "abort", "_pybind11_conduit_v1_", "unbox"}
"""ProcessGroup members the wrapper answers itself: rank and size are fixed for its life and answered
without a communicator (Megatron asks for sizes while the trainer sleeps); shutdown and abort are
no-ops because torch shuts the inner group down under its own table entry (destroy_process_group()
walks every registered group), so forwarding would shut it down twice or fail while it is destroyed."""
_TABLES = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")


class ReloadableGroup(dist.ProcessGroup):
    """A process group whose inner group (and so its communicator) can be destroyed and re-created,
    with this object staying the one Megatron and torch's tables know."""

    def __init__(self, inner: dist.ProcessGroup, ranks: list[int]) -> None:
        super().__init__(inner.rank(), inner.size())
        self._inner: dist.ProcessGroup | None = None
        self.ranks = ranks
        self.attach(inner)

    @property
    def inner(self) -> dist.ProcessGroup:
        """The live inner group; raises while it is destroyed (between destroy_all and rebuild_all)."""
        if self._inner is None:
            raise RuntimeError(
                f"process group of ranks {self.ranks} is destroyed (rlrun.runtime.reloadable_groups."
                f"destroy_all, trainer asleep) and must be rebuilt before it is used because its "
                f"communicator no longer exists; call reloadable_groups.rebuild_all() (Offloader.trainer_wake)"
            )
        return self._inner

    def attach(self, inner: dist.ProcessGroup) -> None:
        """Make ``inner`` the live group and point torch's tables for this wrapper at its entries."""
        world = c10d._world
        for name in _TABLES:
            table = getattr(world, name)
            if inner in table:
                table[self] = table[inner]
        self._inner = inner

    def detach(self) -> dist.ProcessGroup:
        """Forget the inner group (the caller destroys it); this wrapper's table entries stay."""
        inner, self._inner = self.inner, None
        return inner

    def shutdown(self) -> None:
        """No-op: see ``_KEPT``."""

    def abort(self) -> None:
        """No-op: see ``_KEPT``."""


def _forward_method(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _forward_property(name: str) -> property:
    def get(self):
        return getattr(self.inner, name)

    def set_(self, value):
        setattr(self.inner, name, value)

    return property(get, set_)


def _one_rank_or_forward(name: str, local: Callable[..., dist.Work | None]):
    def method(self, *args, **kwargs):
        if self.size() == 1 and (work := local(*args, **kwargs)) is not None:
            return work
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


def _add_one_rank_answers() -> None:
    """The collectives a one-rank wrapper answers itself, for the names the installed torch has."""
    for name, local in one_rank_collectives.BY_METHOD.items():
        if hasattr(dist.ProcessGroup, name):
            setattr(ReloadableGroup, name, _one_rank_or_forward(name, local))


def _add_forwarders() -> None:
    """Forward every method and property of the installed torch's ProcessGroup but ``_KEPT`` to the inner
    group: generated from the class itself, so a torch release adding a collective needs no edit here."""
    for name, member in inspect.getmembers(dist.ProcessGroup):
        if name.startswith("__") or name in _KEPT or name in vars(ReloadableGroup) or isinstance(member, type):
            continue  # vars(ReloadableGroup): its own members (inner, attach, detach) stay its own
        if isinstance(inspect.getattr_static(dist.ProcessGroup, name), property):
            setattr(ReloadableGroup, name, _forward_property(name))
        elif callable(member):
            setattr(ReloadableGroup, name, _forward_method(name))


_add_one_rank_answers()
_add_forwarders()


@dataclass
class _Call:
    """One ``new_group`` call as Megatron made it, and the wrapper it returned (None on a non-member)."""

    arguments: dict
    group: ReloadableGroup | None

    @property
    def multi_rank(self) -> bool:
        """Whether the call made a group of more than one rank (no ``ranks``: the whole world), which every
        rank that made the call reads alike."""
        ranks = self.arguments.get("ranks")
        return len(ranks) > 1 if ranks else dist.get_world_size() > 1


@dataclass
class _Registry:
    world: dist.ProcessGroup
    """The default group at install: after destroy_process_group() and a new init this record is stale."""
    backends: frozenset[str]
    sync_group: dist.ProcessGroup
    calls: list[_Call] = field(default_factory=list)
    destroyed: bool = False
    """Between destroy_all and rebuild_all; the same on every rank, so both stay collective."""


_original_new_group = dist.new_group
_registry: _Registry | None = None


def install(backends: frozenset[str]) -> None:
    """From now on, groups that ``torch.distributed.new_group`` creates on one of ``backends`` (``None``
    meaning the default group's) are :class:`ReloadableGroup` s. Call after ``init_process_group`` and
    before Megatron creates its groups; calling again starts a fresh record (a new world)."""
    global _registry
    backends = frozenset(b.lower() for b in backends)
    _registry = _Registry(dist.GroupMember.WORLD, backends, _original_new_group(backend="gloo"))
    dist.new_group = _new_group


def _active() -> _Registry | None:
    """The record of the current world, or None (never installed, or installed in a world since destroyed)."""
    return _registry if _registry is not None and _registry.world is dist.GroupMember.WORLD else None


def _new_group(*args, **kwargs):
    bound = inspect.signature(_original_new_group).bind(*args, **kwargs)
    group = _original_new_group(*bound.args, **bound.kwargs)
    registry = _active()
    backend = bound.arguments.get("backend") or dist.get_backend()
    if registry is None or not backend_names(backend) & registry.backends:
        return group
    wrapper = None
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        wrapper = ReloadableGroup(group, dist.get_process_group_ranks(group))
    registry.calls.append(_Call(dict(bound.arguments), wrapper))
    return wrapper if wrapper is not None else group


def backend_names(backend: str) -> set[str]:
    """``"nccl"`` -> {nccl}; a backend per device, ``"cpu:gloo,cuda:nccl"`` -> {gloo, nccl}: a group whose
    backends include a reloadable one is reloadable as a whole."""
    return {part.rpartition(":")[2].strip().lower() for part in str(backend).split(",")}


def groups() -> list[ReloadableGroup]:
    """This rank's reloadable groups, in creation order."""
    registry = _active()
    return [call.group for call in (registry.calls if registry else []) if call.group is not None]


def _torn_down_calls(registry: _Registry) -> list[_Call]:
    """The calls whose groups :func:`destroy_all` destroys and :func:`rebuild_all` re-creates."""
    return [call for call in registry.calls if call.multi_rank]


def destroy_all() -> int:
    """Destroy the inner group (its communicator and memory) of every reloadable group of more than one rank;
    returns how many. One-rank groups have no communicator to give back (see the module docstring).

    Collective over all ranks: a gloo barrier first, so no rank tears a group down while a peer may still
    be about to use it. The caller must have finished (synchronised) its work on these groups."""
    registry = _active()
    if registry is None or registry.destroyed:
        return 0
    dist.barrier(group=registry.sync_group)
    torn_down = [call.group for call in _torn_down_calls(registry) if call.group is not None]
    for group in torn_down:
        dist.destroy_process_group(group.detach())
    registry.destroyed = True
    return len(torn_down)


def rebuild_all() -> int:
    """Re-create the inner groups :func:`destroy_all` destroyed, replaying their recorded ``new_group``
    calls in order on every rank (collective over all ranks); returns how many this rank rebuilt."""
    registry = _active()
    if registry is None or not registry.destroyed:
        return 0
    rebuilt = 0
    for call in _torn_down_calls(registry):
        inner = _original_new_group(**call.arguments)
        if call.group is not None:
            call.group.attach(inner)
            rebuilt += 1
    registry.destroyed = False
    return rebuilt


def one_rank_groups_with_communicator() -> int:
    """How many one-rank groups ran a collective on their real group (one :mod:`one_rank_collectives` does not answer),
    which gave them a communicator that is never torn down (on NCCL, device memory the sleeping trainer keeps)."""
    return sum(g.size() == 1 and g.inner._get_sequence_number_for_group() > 0 for g in groups())
