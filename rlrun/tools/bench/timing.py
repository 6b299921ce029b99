"""Wall-clock timing that waits for the GPU, so a timed region ends when its kernels have run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def timer(device: torch.device) -> Iterator[list[float]]:
    """``with timer(device) as t: ...`` then ``t[0]`` is the seconds the block took (CUDA synchronised)."""
    elapsed: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield elapsed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed.append(time.perf_counter() - start)


def hardware(device: torch.device) -> str:
    """The device's name as results record it (``cpu`` or the CUDA device name)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
