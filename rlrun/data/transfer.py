"""Moving rollout data between ranks with torch.distributed object collectives (gloo control group).

Objects travel pickled; on one host that is a memcpy, and rollout data is small next to weights.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def scatter_from_rank0(per_rank: list[Any] | None, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0 passes one object per rank (``None`` elsewhere); every rank returns its own object."""
    world_size = dist.get_world_size(group)
    if dist.get_rank(group) == 0:
        if per_rank is None or len(per_rank) != world_size:
            raise ValueError(
                f"rank 0 must scatter exactly {world_size} objects, got {None if per_rank is None else len(per_rank)}"
            )
    if world_size == 1 and per_rank is not None:  # nobody to send to: no pickle round trip at every step
        return per_rank[0]
    received: list[Any] = [None]
    dist.scatter_object_list(received, per_rank if dist.get_rank(group) == 0 else None, src=0, group=group)
    return received[0]


def gather_to_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank passes an object; rank 0 returns them in rank order, the others ``None``."""
    is_rank0 = dist.get_rank(group) == 0
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if is_rank0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return gathered


def all_gather(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank passes an object and receives everyone's, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
