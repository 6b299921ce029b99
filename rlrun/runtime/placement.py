"""Ranks of a disaggregated job (``placement.engine_ranks``) and the link between training rank 0 and them.

    torchrun ranks:  0 .. T-1   train (Megatron's world, the default process group)
                     T .. W-1   engine ranks 0 .. N-1, ``engine.tp`` consecutive ones per engine (their own
                                default process group, gloo, for the engine groups; no Megatron)

The two kinds share no default process group, so the link is two process groups built directly on the
rendezvous store over rank 0 and the engine ranks (link rank 0 is global rank 0, link rank ``1 + e`` is
engine rank ``e``): ``control`` (gloo) carries pickled messages point to point (prompts out, scored samples
back), ``weights`` the broadcast of the trained weights, GPU to GPU over NCCL where the ranks have GPUs and
through host memory over gloo on CPU (:func:`weights_backend`). They are not registered with
torch.distributed (neither world contains both kinds), so they are driven through the process group's own
methods. Each is used by one thread at a time (the loop's, or the rollout thread's with
``rollout.max_staleness`` > 0).
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from rlrun.runtime.dist import DistEnv

LINK_TIMEOUT = timedelta(hours=24)
"""An engine rank waits for its next message while the trainers train a step, however long that is; a peer
that died is the watchdog's to report (rlrun/runtime/watchdog.py), within seconds, not this timeout's."""


def num_training_ranks(env: DistEnv, engine_ranks: int) -> int:
    """The ranks that train: all but the last ``engine_ranks``; raises when none would."""
    if engine_ranks >= env.world_size:
        raise ValueError(
            f"placement.engine_ranks ({engine_ranks}) must be smaller than the number of processes "
            f"({env.world_size}) because at least one rank trains; launch more ranks or lower it"
        )
    return env.world_size - engine_ranks


def is_engine_rank(env: DistEnv, engine_ranks: int) -> bool:
    return engine_ranks > 0 and env.rank >= num_training_ranks(env, engine_ranks)


def _store(env: DistEnv) -> dist.Store:
    return dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=LINK_TIMEOUT)


def _prefix() -> str:
    """This torchrun attempt's keys: a restart reuses the agent's store, and an earlier attempt's must not leak in."""
    env = os.environ
    return f"rlrun-placement/{env.get('TORCHELASTIC_RUN_ID', 'local')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _arrive(store: dist.Store, key: str, size: int) -> None:
    """Wait, asleep (the GIL free for the watchdog's thread), until ``size`` processes have arrived at ``key``."""
    store.add(key, 1)
    while store.add(key, 0) < size:
        time.sleep(0.1)


def join_engine_world(env: DistEnv, engine_ranks: int) -> None:
    """Engine ranks: the default process group over the engine ranks alone (gloo, engine rank ``e`` is its rank
    ``e``), in which ``EngineGroup.spawn`` forms the engine groups of ``engine.tp`` ranks."""
    first_engine = num_training_ranks(env, engine_ranks)
    store = dist.PrefixStore(f"{_prefix()}engines/", _store(env))
    _arrive(store, "joined", engine_ranks)  # as in Link.open: gloo's constructor holds the GIL while it waits
    dist.init_process_group(
        "gloo", store=store, rank=env.rank - first_engine, world_size=engine_ranks, timeout=LINK_TIMEOUT
    )


def weights_backend(device: torch.device) -> str:
    """The weight broadcast's backend: NCCL between the ranks' own GPUs, gloo through host memory on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def all_ranks_started(env: DistEnv) -> None:
    """Every torchrun rank, training and engine ranks alike, before it starts its watchdog: the two kinds share
    no process group whose rendezvous would line them up, and a watchdog that starts while its neighbour still
    imports would count the import as silence (rlrun/runtime/watchdog.py)."""
    _arrive(_store(env), f"{_prefix()}started", env.world_size)


class Link:
    """Training rank 0 and the engine ranks: messages and weight buckets (see the module docstring)."""

    def __init__(
        self, control: dist.ProcessGroup, weights: dist.ProcessGroup, rank: int, size: int, device: torch.device
    ) -> None:
        self.control = control
        self.weights = weights
        self.rank = rank
        """0 on training rank 0, ``1 + e`` on engine rank ``e``."""
        self.size = size
        self.device = device
        """Where this rank's weight buffers live: its GPU (NCCL) or the host (gloo)."""

    @classmethod
    def open(cls, env: DistEnv, engine_ranks: int, device: torch.device) -> Link:
        """Collective over rank 0 and the engine ranks (the other training ranks never call it); ``device`` is
        this rank's (cuda:local_rank or cpu) and must be of one type on every member."""
        first_engine = num_training_ranks(env, engine_ranks)
        rank = 0 if env.rank == 0 else 1 + env.rank - first_engine
        store, prefix = _store(env), _prefix()
        # gloo's constructor waits for every member holding the GIL, which would silence this rank's watchdog
        # heartbeat while the trainers still load; wait here, asleep, until all have arrived.
        _arrive(store, f"{prefix}link", 1 + engine_ranks)
        size = 1 + engine_ranks

        def group(name: str, backend: str) -> dist.ProcessGroup:
            named = dist.PrefixStore(f"{prefix}{name}/", store)
            if backend == "gloo":
                return dist.ProcessGroupGloo(named, rank, size, LINK_TIMEOUT)
            torch.cuda.set_device(device)  # NCCL's communicator uses the current device
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = LINK_TIMEOUT
            return dist.ProcessGroupNCCL(named, rank, size, options)

        return cls(group("control", "gloo"), group("weights", weights_backend(device)), rank, size, device)

    # ---- messages (control) ----------------------------------------------------------------------

    def send(self, obj: Any, dst: int) -> None:
        """Pickle ``obj`` to link rank ``dst`` (its length first, then the bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.control.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.control.send([data], dst, 0).wait()

    def recv(self, src: int) -> Any:
        """The next object link rank ``src`` sent to this rank."""
        size = torch.zeros(1, dtype=torch.int64)
        self.control.recv([size], src, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.recv([data], src, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    # ---- weights (broadcast from link rank 0) ------------------------------------------------------

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.weights.broadcast([tensor], opts).wait()

    def _broadcast_object(self, obj: Any) -> Any:
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self._broadcast(size)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            if self.rank == 0
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        self._broadcast(buf)
        return pickle.loads(buf.cpu().numpy().tobytes())

    def send_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
        """Link rank 0: broadcast every tensor, packed as raw bytes into buckets of about ``bucket_bytes``
        (a tensor larger than that travels alone); each bucket's names, dtypes and shapes go first."""
        bucket: list[tuple[str, torch.Tensor]] = []
        num_bytes = 0
        for name, tensor in named_tensors:
            tensor = tensor.detach().to(self.device).contiguous()
            if bucket and num_bytes + tensor.nbytes > bucket_bytes:
                self._send_bucket(bucket)
                bucket, num_bytes = [], 0
            bucket.append((name, tensor))
            num_bytes += tensor.nbytes
        if bucket:
            self._send_bucket(bucket)
        self._broadcast_object(None)  # the end

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self._broadcast_object([(name, t.dtype, tuple(t.shape)) for name, t in bucket])
        self._broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]))

    def recv_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Engine ranks: the tensors :meth:`send_weights` broadcasts, bucket by bucket (iterate to the end), on
        this rank's device: on GPUs the engine worker takes them by the colocated CUDA-IPC handover."""
        while (meta := self._broadcast_object(None)) is not None:
            sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in meta]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self._broadcast(flat)
            for (name, dtype, shape), part in zip(meta, flat.split(sizes), strict=True):
                yield name, part.clone().view(dtype).reshape(shape)  # clone: aligned for the wider dtype
