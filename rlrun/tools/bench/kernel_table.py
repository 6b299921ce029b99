"""The torch profiler over a benchmark's chosen work, and its kernel-time table as text (``bench train --profile``,
``bench rollout --profile``): top rows by device time on CUDA, by CPU self time on CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

TABLE_ROWS = 40


def profiled(work: Callable[[], None]):
    """``work()`` under the torch profiler (CPU activity, plus CUDA where there is a GPU), the device synchronised
    before the profiler stops so every kernel is recorded; returns the profiler (``.events()``, ``.key_averages()``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof


def write_kernel_table(prof, path: Path) -> None:
    """The top :data:`TABLE_ROWS` ops and kernels of ``prof`` by self device time (CPU: self CPU time) at ``path``."""
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=TABLE_ROWS, max_name_column_width=90))
