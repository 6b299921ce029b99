"""``rlrun bench sync``: colocated weight sync, Megatron trainer -> embedded engine worker, per shape.

One process plays a TP=1 trainer rank: it builds the Megatron model from a random HF directory of the
shape, spawns an embedded engine worker on the same device, and times ``engine.update_weights(
export_hf_weights(model), ...)`` end to end: HF-name conversion, bucket packing, CUDA IPC or shared
memory transfer, engine load, and the engine's reply to ``end_weight_update``, which it sends only
after its copies have finished on the GPU, so the time covers weights that are really in place.
After each timed sync a one-token generate (the probe, timed separately as ``probe_s``) checks
that the engine serves with them. GB/s = bf16 weight bytes / median seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from rlrun.tools.bench.shapes import get_shape, write_random_model
from rlrun.tools.bench.timing import hardware, timer

DEFAULT_BUCKET_BYTES = 512 * 2**20
PROBE = {"max_new_tokens": 1, "temperature": 0.0}


@dataclasses.dataclass(frozen=True)
class SyncResult:
    """One shape's ``bench sync`` measurement (times in seconds, rates in 1e9 bytes per second)."""

    shape: str
    hardware: str
    dtype: str
    bucket_bytes: int
    weight_bytes: int
    """Bytes sent: the exported HF tensors (a tied embedding once), in the engine's dtype."""
    num_buckets: int
    seconds: list[float]
    """Each timed sync, after one warm-up: ``update_weights`` returning with the weights in place."""
    median_s: float
    gb_per_s: float
    """weight_bytes / median_s / 1e9: end to end, weights in place."""
    probe_s: list[float]
    """The one-token generate after each timed sync (not inside ``seconds``)."""
    backend: str = "embedded"
    """The engine worker's backend (``--backends``); sglang ends a sync when its scheduler has loaded."""


def sync_once(engine, model, version: str, bucket_bytes: int, device: torch.device) -> tuple[dict, float, float]:
    """One timed sync then one timed probe; returns (update stats, sync seconds, probe seconds)."""
    from rlrun.megatron import export_hf_weights

    with timer(device) as sync_s:
        stats = engine.update_weights(
            export_hf_weights(model, fresh=False), weight_version=version, bucket_bytes=bucket_bytes
        )
    with timer(device) as probe_s:
        engine.generate([[2]], PROBE, return_logprob=False)
    return stats, sync_s[0], probe_s[0]


@contextlib.contextmanager
def trainer_and_engine(shape: str, parallel, run_dir: Path, dtype: str, backend: str = "embedded") -> Iterator:
    """``(model, engine)``: a TP=1 Megatron model of a random HF model of ``shape`` and an engine worker of the same
    weights on the same device, the engine shut down on leaving."""
    from rlrun.engine.client import EngineClient
    from rlrun.megatron import build_model
    from rlrun.tools.bench.engines import bench_spec

    with tempfile.TemporaryDirectory(prefix="rlrun-bench-", dir=run_dir) as tmp:
        hf_dir = write_random_model(get_shape(shape), Path(tmp), getattr(torch, dtype), str(parallel.device))
        model = build_model(str(hf_dir), parallel, dtype=dtype)
        if parallel.device.type == "cuda":  # the load's staging memory, cached: the engine takes the card next
            torch.cuda.empty_cache()
        spec = bench_spec(backend, hf_dir, dtype, parallel.device.index or 0)
        with EngineClient.spawn(spec, run_dir=run_dir, rank=0, startup_timeout_s=600) as engine:
            yield model, engine


def bench_sync_shape(
    shape: str,
    parallel,
    run_dir: Path,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    repeats: int = 3,
    dtype: str = "bfloat16",
    backend: str = "embedded",
) -> SyncResult:
    """Warm up once, then time ``repeats`` syncs of one shape; frees the model and worker before returning."""
    with trainer_and_engine(shape, parallel, run_dir, dtype, backend) as (model, engine):
        sync_once(engine, model, "warmup", bucket_bytes, parallel.device)
        runs = [sync_once(engine, model, str(i), bucket_bytes, parallel.device) for i in range(repeats)]
    del model
    gc.collect()
    if parallel.device.type == "cuda":
        torch.cuda.empty_cache()
    stats, times, probes = runs[-1][0], [r[1] for r in runs], [r[2] for r in runs]
    median = statistics.median(times)
    return SyncResult(
        shape=shape,
        hardware=hardware(parallel.device),
        dtype=dtype,
        bucket_bytes=bucket_bytes,
        weight_bytes=stats["num_bytes"],
        num_buckets=stats["num_buckets"],
        seconds=times,
        median_s=median,
        gb_per_s=stats["num_bytes"] / median / 1e9,
        probe_s=probes,
        backend=backend,
    )


def bench_sync(
    shapes: list[str],
    run_dir: Path,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    repeats: int = 3,
    backends: tuple[str, ...] = ("embedded",),
) -> Iterator[SyncResult]:
    """Yield each shape's result as it is measured (so a later shape's failure keeps the earlier ones),
    in one single-rank process group (NCCL on GPU, gloo on CPU) torn down at the end."""
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    for shape in shapes:
        get_shape(shape)  # fail on a bad name before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    parallel = init_distributed(tp=1, pp=1, seed=0)
    dtype = "bfloat16" if parallel.device.type == "cuda" else "float32"
    try:
        for shape in shapes:
            for backend in backends:
                yield bench_sync_shape(shape, parallel, run_dir, bucket_bytes, repeats, dtype, backend)
    finally:
        destroy_distributed()
