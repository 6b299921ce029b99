"""CUDA-event timing and the commit stamp shared by the kernel benchmarks of this folder (rope_kernel_bench.py,
rmsnorm_kernel_bench.py), which run as scripts: ``python scripts/gpu/<name>.py`` puts this folder on the path."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def median_us(fn: Callable[[], object], iters: int, repeats: int, graph: bool = False) -> float:
    """Median microseconds a call of ``fn`` (``iters`` calls a timing), plain launches or one CUDA graph replay."""
    fn()  # compiles the kernel before any capture
    torch.cuda.synchronize()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(iters):
                fn()
        run: Callable[[], object] = captured.replay
    else:

        def run() -> None:
            for _ in range(iters):
                fn()

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / iters)
    return statistics.median(times)


def git_commit() -> str | None:
    """The checkout's commit, for the JSON (None outside a git checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() or None


def report(rows: list[dict], args: argparse.Namespace, **extra: object) -> None:
    """Print the benchmark's JSON (the machine, versions, commit, ``extra``, the timing settings and ``rows``) and
    write it to ``args.out`` where given."""
    import triton

    text = json.dumps(
        {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "commit": git_commit(),
            **extra,
            "iters": args.iters,
            "repeats": args.repeats,
            "results": rows,
        },
        indent=1,
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
