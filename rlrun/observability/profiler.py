"""torch profiler traces of chosen steps: ``logging.profile_steps`` on ``logging.profile_ranks``.

Each profiled step writes ``RUN_DIR/profile/step_<N>-rank_<R>.json``, a Chrome trace (open it in
https://ui.perfetto.dev or chrome://tracing). The loop's phases (rollout, logprobs, train, sync, ...)
appear in it as named ranges because :class:`rlrun.observability.metrics.PhaseTimer` wraps each in
``record_function``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rlrun.config.schema import LoggingConfig


def trace_path(run_dir: str | Path, step: int, rank: int) -> Path:
    return Path(run_dir) / "profile" / f"step_{step}-rank_{rank}.json"


@contextmanager
def profile_step(cfg: LoggingConfig, rank: int, step: int) -> Iterator[None]:
    """Record ``step`` on this rank if the config asks for it; otherwise do nothing."""
    if step not in cfg.profile_steps or rank not in cfg.profile_ranks:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    path = trace_path(cfg.run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
