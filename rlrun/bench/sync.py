"""``rlrun bench sync``: colocated weight sync, Megatron trainer -> embedded engine worker, per shape.

One process plays a TP=1 trainer rank: it builds the Megatron model from a random HF directory of the
shape, spawns an embedded engine worker on the same device, and times ``engine.update_weights(
export_hf_weights(model), ...)`` end to end (HF-name conversion, bucket packing, CUDA IPC or shared
memory transfer, engine load) plus a one-token generate, which cannot start before the worker's
copies have finished, so the time covers weights that are really in place. ``probe_s`` (that
generate alone) is reported so it can be subtracted. GB/s = bf16 weight bytes / median seconds.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from rlrun.bench.shapes import get_shape, write_random_model
from rlrun.bench.timing import hardware, timer

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
    """Each timed sync (update + probe) after one warm-up."""
    median_s: float
    probe_s: float
    """The one-token probe generate alone, right after the timed syncs."""
    gb_per_s: float
    """weight_bytes / median_s / 1e9: end to end, weights usable by the engine."""
    update_s: list[float]
    """The ``update_weights`` call alone in each timed sync, as the client sees it returning (the
    worker's last GPU copies may still be in flight then; the probe waits for them)."""
    update_gb_per_s: float
    """weight_bytes / median(update_s) / 1e9: an upper estimate."""


def _sync_once(engine, model, version: str, bucket_bytes: int) -> dict:
    from rlrun.megatron import export_hf_weights

    stats = engine.update_weights(export_hf_weights(model), weight_version=version, bucket_bytes=bucket_bytes)
    engine.generate([[2]], PROBE, return_logprob=False)
    return stats


def bench_sync_shape(shape: str, parallel, run_dir: Path, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                     repeats: int = 3, dtype: str = "bfloat16") -> SyncResult:
    """Warm up once, then time ``repeats`` syncs of one shape; frees the model and worker before returning."""
    from rlrun.engine.client import EngineClient
    from rlrun.megatron import build_model

    with tempfile.TemporaryDirectory(prefix="rlrun-bench-", dir=run_dir) as tmp:
        hf_dir = write_random_model(get_shape(shape), Path(tmp), getattr(torch, dtype), str(parallel.device))
        model = build_model(str(hf_dir), parallel, dtype=dtype)
        with EngineClient.spawn(backend="embedded", model_path=hf_dir, run_dir=run_dir, rank=0, seed=0,
                                dtype=dtype, base_gpu_id=parallel.device.index or 0) as engine:
            _sync_once(engine, model, "warmup", bucket_bytes)
            times, updates, stats = [], [], {}
            for i in range(repeats):
                with timer(parallel.device) as t:
                    stats = _sync_once(engine, model, str(i), bucket_bytes)
                times.append(t[0])
                updates.append(stats["seconds"])
            with timer(parallel.device) as probe:
                engine.generate([[2]], PROBE, return_logprob=False)
    del model
    gc.collect()
    if parallel.device.type == "cuda":
        torch.cuda.empty_cache()
    median = statistics.median(times)
    return SyncResult(shape=shape, hardware=hardware(parallel.device), dtype=dtype, bucket_bytes=bucket_bytes,
                      weight_bytes=stats["num_bytes"], num_buckets=stats["num_buckets"], seconds=times,
                      median_s=median, probe_s=probe[0], gb_per_s=stats["num_bytes"] / median / 1e9,
                      update_s=updates, update_gb_per_s=stats["num_bytes"] / statistics.median(updates) / 1e9)


def bench_sync(shapes: list[str], run_dir: Path, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
               repeats: int = 3) -> Iterator[SyncResult]:
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
            yield bench_sync_shape(shape, parallel, run_dir, bucket_bytes, repeats, dtype)
    finally:
        destroy_distributed()
