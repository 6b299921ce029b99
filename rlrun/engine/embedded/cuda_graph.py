"""One decode step as a CUDA graph: captured once, replayed with a single launch per step.

A small model's decode step is hundreds of small kernels, each launched from Python; at batch 64 the
GPU finishes them faster than the host issues them (BENCHMARKS.md, "Embedded engine against transformers
`generate`"). Replaying a captured graph removes the host from the step.
The step function must only read and write tensors that outlive the graph (its static buffers) and
must not synchronise with the host; on CPU the same function is simply called.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

WARMUP_STEPS = 2
"""Eager runs before capture, on the capture stream: cuBLAS handles and workspaces are created lazily."""


class StepGraph:
    """``run()`` executes ``step`` once: as a replay of its CUDA graph on GPU, as a call on CPU.

    Capture runs ``step`` ``WARMUP_STEPS`` times for real first, so capture before loading the real
    state into the buffers. If capture fails (an operation that cannot be captured), the step runs
    eagerly and :attr:`captured` is False, with a warning: slower, still correct.
    """

    def __init__(self, step: Callable[[], None], device: torch.device, pool: Any = None) -> None:
        """``pool`` (``torch.cuda.graph_pool_handle()``): a memory pool shared with the other steps of one
        batch; safe because their replays never overlap and a step keeps nothing in the pool between replays
        (every result is copied into the batch's buffers, allocated outside any graph)."""
        self.step = step
        self.graph: torch.cuda.CUDAGraph | None = None
        if device.type == "cuda":
            self.graph = self._capture(step, device, pool)

    @property
    def captured(self) -> bool:
        return self.graph is not None

    @staticmethod
    def _capture(step: Callable[[], None], device: torch.device, pool: Any) -> torch.cuda.CUDAGraph | None:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the worker's event-loop thread may touch CUDA (a weight load) meanwhile.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                step()
        except RuntimeError as exc:
            log.warning("decode step could not be captured as a CUDA graph (%s); running it eagerly", exc)
            torch.cuda.synchronize(device)
            return None
        return graph

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()
