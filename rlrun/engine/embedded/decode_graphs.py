"""Decode batches kept warm between generate calls: per batch shape its buffers and one captured step per
read length.

A decode step reads only the filled part of the KV cache (:attr:`StaticKVCache.read_len`, a bucket of
:data:`READ_ALIGN` columns), so one call replays a few captured steps, one per bucket it reaches; each is
captured the first time a call reaches it and kept with the batch. Several batch shapes stay warm (eval and
rollout calls, a short last batch), least recently used dropped first, bounded in count and in bytes.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable

import torch

from rlrun.engine.embedded.cuda_graph import StepGraph
from rlrun.engine.embedded.decode_batch import BatchShape, DecodeBatch

READ_ALIGN = 128
"""Decode attention reads the filled cache columns rounded up to this many. A multiple of the CUDA attention
kernel's key block (64 or 128 keys in torch's memory-efficient kernel), so the blocks that hold attended keys
are the same as over the whole cache: the leftover blocks are fully masked and add exact zeros."""
MAX_WARM_SHAPES = 4
"""Batch shapes kept warm on CUDA (on CPU nothing is captured, so only the last call's buffers are kept)."""
WARM_BYTES = 16 * 2**30
"""Bytes of decode buffers (KV cache first) the warm shapes may hold together on CUDA, besides the one in use;
at most :data:`WARM_FRACTION` of the device's memory."""
WARM_FRACTION = 0.1


def read_len(filled: int, max_len: int) -> int:
    """The cache columns a step reads when no row attends past column ``filled - 1``."""
    return min(-(-filled // READ_ALIGN) * READ_ALIGN, max_len)


class WarmBatch:
    """One shape's decode buffers and its captured steps by read length (captured on first use)."""

    def __init__(
        self, batch: DecodeBatch, step: Callable[[DecodeBatch, int], None], device: torch.device, pool=None
    ) -> None:
        self.batch = batch
        self.step = step
        """``step(batch, read_len)``: one decode step on the batch's buffers."""
        self.device = device
        self.graphs: dict[int, StepGraph] = {}
        if pool is None and device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
        self.pool = pool
        self.heads: dict[int, WarmBatch] = {}
        """Smaller batches over this one's first rows (:meth:`head`), with their own captured steps."""

    def head(self, rows: int) -> WarmBatch:
        """The first ``rows`` rows as a warm batch of their own (views of these buffers, steps captured apart
        into the same pool: one step runs at a time), made on first use and kept with this one."""
        if rows == self.batch.num_rows:
            return self
        head = self.heads.get(rows)
        if head is None:
            head = self.heads[rows] = WarmBatch(self.batch.head(rows), self.step, self.device, self.pool)
        return head

    def run(self, length: int) -> None:
        """One step reading ``length`` columns. A capture mid-call runs the step for real (warm-up) on the
        live buffers, so their state is restored afterwards; the warm-up's K/V writes land on columns each row
        writes again before it attends to them."""
        graph = self.graphs.get(length)
        if graph is None:
            saved = self.batch.snapshot() if self.device.type == "cuda" else None
            # A partial, not a closure over ``self``: a graph that referred back to its WarmBatch made a reference
            # cycle, so dropping the batch (a release, an eviction) left its KV cache alive until a later garbage
            # collection, after the release's empty_cache: a rollout's whole KV cache stayed on the device while
            # the trainer trained.
            graph = StepGraph(functools.partial(self.step, self.batch, length), self.device, self.pool)
            if saved is not None:
                self.batch.restore(saved)
            self.graphs[length] = graph
        graph.run()

    @property
    def captured(self) -> bool:
        return bool(self.graphs) and all(g.captured for g in self.graphs.values())


class WarmBatches:
    """Warm decode batches by shape, least recently used first out."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._batches: collections.OrderedDict[BatchShape, WarmBatch] = collections.OrderedDict()
        self.budget_bytes = WARM_BYTES
        if device.type == "cuda" and torch.cuda.is_available():
            total = torch.cuda.get_device_properties(device).total_memory
            self.budget_bytes = min(WARM_BYTES, int(WARM_FRACTION * total))

    def get(self, shape: BatchShape, make: Callable[[], WarmBatch]) -> WarmBatch:
        """The warm batch of ``shape``; when there is none, the oldest others are dropped down to the bounds
        first (their memory is free before the new buffers are allocated), then it is made."""
        warm = self._batches.pop(shape, None)
        if warm is None:
            keep = MAX_WARM_SHAPES - 1 if self.device.type == "cuda" else 0
            while len(self._batches) > keep or (self._batches and self.nbytes() > self.budget_bytes):
                self._batches.popitem(last=False)
            warm = make()
        self._batches[shape] = warm
        return warm

    def nbytes(self) -> int:
        return sum(w.batch.nbytes() for w in self._batches.values())

    @property
    def last(self) -> WarmBatch | None:
        return next(reversed(self._batches.values()), None)

    def clear(self) -> None:
        self._batches.clear()
