"""Collectives of a one-rank group, answered in place without a communicator.

Why: on one rank every collective is the identity (all-reduce, broadcast, barrier) or a copy (all-gather or
reduce-scatter into another tensor), yet NCCL creates a communicator for the group at its first collective: device
memory outside torch's allocator (BENCHMARKS.md, "Offload: trainer and engine taking turns on one GPU") and its start-up
time. Megatron makes many one-rank groups (every group on one GPU; the TP, PP, CP, ... groups of size 1 on more) and
reduces gradients and norms over some of them at every step. With the offloader's NCCL teardown each step would destroy
and re-create those communicators, a visible part of every sleep and of the next train phase (BENCHMARKS.md, "Offload",
and the "NCCL kept" row of the first TRL measurements in its appendix). Answered here, they never exist, so there is
nothing to tear down (rlrun/runtime/reloadable_groups.py wraps the groups and calls these).

Each function takes the arguments of the ``ProcessGroup`` method of its name, as torch.distributed's
functions pass them (lists of tensors and an options object), and returns a finished ``Work``; or None for
what it does not answer, which the caller forwards to the real group: a pre-multiplied sum (its factor
scales even one rank's tensor) and any other calling form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

Work = dist.Work


def _finished(result: list[torch.Tensor]) -> Work:
    """A Work that is already complete: ``wait()`` returns at once; its future holds ``result``. Any copy
    made for it was queued on the current stream, where the real collective would have run."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _tensors(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value)


def _identity(opts: object) -> bool:
    """Whether the options' reduction leaves one rank's tensor as it is (all but a pre-multiplied sum)."""
    op = getattr(opts, "reduceOp", None)
    return op is not None and op.op != dist.ReduceOp.RedOpType.PREMUL_SUM


def _copy(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    for output, source in zip(outputs, inputs, strict=True):
        if output.data_ptr() != source.data_ptr():  # Megatron's one-rank shard is its whole buffer: no copy
            output.copy_(source.reshape(output.shape))
    return outputs


def allreduce(tensors: object, opts: object = None) -> Work | None:
    """``allreduce(tensors, AllreduceOptions)`` and ``allreduce_coalesced(tensors, AllreduceCoalescedOptions)``."""
    return _finished(tensors) if _tensors(tensors) and _identity(opts) else None  # type: ignore[arg-type]


def broadcast(tensors: object, opts: object = None) -> Work | None:
    """``broadcast(tensors, BroadcastOptions)``: the only rank is the root."""
    return _finished(tensors) if _tensors(tensors) and opts is not None else None  # type: ignore[arg-type]


def barrier(opts: object = None) -> Work | None:
    """``barrier(BarrierOptions)``: nobody to wait for."""
    return _finished([]) if opts is not None else None


def allgather(outputs: object, inputs: object, opts: object = None) -> Work | None:
    """``allgather(outputs: list[list[Tensor]], inputs: list[Tensor], AllgatherOptions)``: each output list
    holds one tensor per rank, here one."""
    if not (_tensors(inputs) and isinstance(outputs, list) and all(_tensors(o) and len(o) == 1 for o in outputs)):
        return None
    return _finished(_copy([o[0] for o in outputs], inputs))  # type: ignore[arg-type, index]


def gather_into_tensor(output: object, source: object, opts: object = None) -> Work | None:
    """``all_gather_single(output, input, AllgatherOptions)`` (``all_gather_into_tensor``; ``_allgather_base``
    in torch 2.11): one rank's shard is the whole output."""
    if not (isinstance(output, torch.Tensor) and isinstance(source, torch.Tensor)) or output.numel() != source.numel():
        return None
    return _finished(_copy([output], [source]))


def reduce_scatter_tensor(output: object, source: object, opts: object = None) -> Work | None:
    """``reduce_scatter_single(output, input, ReduceScatterOptions)`` (``reduce_scatter_tensor``;
    ``_reduce_scatter_base`` in torch 2.11)."""
    if not _identity(opts):
        return None
    return gather_into_tensor(output, source)


def gather_into_tensors(outputs: object, inputs: object, opts: object = None) -> Work | None:
    """The coalesced all-gathers into tensors (torch's coalescing manager, as Megatron's distributed optimizer
    gathers its parameters)."""
    if not (_tensors(outputs) and _tensors(inputs)) or len(outputs) != len(inputs):  # type: ignore[arg-type]
        return None
    if any(o.numel() != i.numel() for o, i in zip(outputs, inputs, strict=True)):  # type: ignore[arg-type]
        return None
    return _finished(_copy(outputs, inputs))  # type: ignore[arg-type]


def reduce_scatter_tensors(outputs: object, inputs: object, opts: object = None) -> Work | None:
    """The coalesced reduce-scatters into tensors (Megatron's distributed optimizer reducing gradients)."""
    if not _identity(opts):
        return None
    return gather_into_tensors(outputs, inputs)


BY_METHOD: dict[str, Callable[..., Work | None]] = {
    "allreduce": allreduce,
    "allreduce_coalesced": allreduce,
    "broadcast": broadcast,
    "barrier": barrier,
    "allgather": allgather,
    "_allgather_base": gather_into_tensor,  # torch 2.11's name; 2.13 calls it all_gather_single
    "all_gather_single": gather_into_tensor,
    "_reduce_scatter_base": reduce_scatter_tensor,
    "reduce_scatter_single": reduce_scatter_tensor,
    "allgather_into_tensor_coalesced": gather_into_tensors,
    "all_gather_single_coalesced": gather_into_tensors,
    "reduce_scatter_tensor_coalesced": reduce_scatter_tensors,
    "reduce_scatter_single_coalesced": reduce_scatter_tensors,
}
"""``ProcessGroup`` method name -> its one-rank answer; names the installed torch lacks are never called."""
