"""How a full tensor is split over tensor-parallel ranks, read from Megatron's parameter attributes.

Megatron marks each TP-sharded parameter with ``tensor_model_parallel=True``, ``partition_dim`` and
``partition_stride``. With stride ``s`` the full tensor is cut into ``tp * s`` equal chunks along
``partition_dim`` and rank ``r`` holds chunks ``r, r + tp, ...``: for SwiGLU's ``linear_fc1 = [gate; up]``
(stride 2) rank ``r`` holds ``[gate_r; up_r]``. Parameters without the flag are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Partition:
    """The TP split of one parameter; ``dim is None`` means replicated."""

    dim: int | None
    stride: int

    @classmethod
    def of(cls, param: torch.Tensor) -> Partition:
        if not getattr(param, "tensor_model_parallel", False):
            return cls(None, 1)
        return cls(param.partition_dim, getattr(param, "partition_stride", 1))

    def shard(self, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's slice of ``full``."""
        if self.dim is None:
            return full
        chunks = full.chunk(tp_size * self.stride, dim=self.dim)
        return torch.cat(chunks[tp_rank::tp_size], dim=self.dim)

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's slice, in TP-rank order (inverse of ``shard``)."""
        if self.dim is None:
            return shards[0]
        pieces = [shard.chunk(self.stride, dim=self.dim) for shard in shards]
        return torch.cat([pieces[r][s] for s in range(self.stride) for r in range(len(shards))], dim=self.dim)

    def gather(self, local: torch.Tensor, size: int, group: dist.ProcessGroup) -> torch.Tensor:
        """Collective over ``group`` (the ``size`` ranks that split the parameter: TP, or ETP for experts): the
        full tensor from every rank's ``local`` shard; ``local`` itself when it is replicated or not split."""
        if self.dim is None or size == 1:
            return local
        local = local.contiguous()
        shards = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(shards, local, group=group)
        return self.unshard(shards)
