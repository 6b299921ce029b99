"""``rlrun bench rollout --backends embedded,sglang``: engine backends side by side through rlrun's own
worker and RPC (``EngineClient``), on one random model of a published shape, in one run.

Every backend gets the same weights (one random HF directory), the same prompts and lengths, and the same calls as the
in-process benchmark (greedy, then sampled at temperature 1 with top-p 0.95), each after an untimed call of the same
shape (CUDA graphs, JIT) and timed :data:`REPEATS` times (the median counts). Workers run one at a time, each shut down
before the next starts, so neither sees the other's memory. Tokens/s includes the RPC round trip, which a trainer pays
too. Each worker runs at most ``batch`` requests at once
(``max_running_requests``, both backends' server argument).

The long-tail workload (:class:`LongTail`) sends ``requests_per_slot x batch`` prompts in one call, each with
its own ``max_new_tokens`` drawn from a lognormal (EOS allowed, sampled and seeded per request), so requests
end at very different times and an engine that cannot refill ended slots idles; tokens/s counts the tokens
actually produced.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlrun.engine.registry import BackendSpec, backend_traits
from rlrun.kernels.attention import engine_kernel_family
from rlrun.tools.bench.decode_profile import DecodeProfile, profile_decode
from rlrun.tools.bench.rollout import (
    GREEDY,
    SAMPLED,
    BandwidthBound,
    Throughput,
    card_hbm_bytes_per_s,
    kv_bytes_per_token,
    profile_path,
)
from rlrun.tools.bench.shapes import get_shape, write_random_model
from rlrun.tools.bench.timing import hardware, timer

SGLANG_SERVER_ARGS: dict[str, Any] = {
    "mem_fraction_static": 0.3,
    "sampling_backend": "pytorch",
    "skip_tokenizer_init": True,
}
"""What the benchmarks start ``sglang.Engine`` with: KV cache from 30% of the device (a trainer shares
it in ``bench sync``), PyTorch sampling (no FlashInfer JIT), token ids only (the random model has no
tokenizer)."""
BENCH_SERVER_ARGS: dict[str, dict[str, Any]] = {"sglang": SGLANG_SERVER_ARGS}
"""The server arguments the benchmarks tune per backend (backends absent here start with none)."""


@dataclasses.dataclass(frozen=True)
class LongTail:
    """Response lengths ``min(max_new_tokens, max(1, round(exp(N(log(median), sigma)))))``, one per request,
    from a seeded generator: the same for every backend."""

    requests_per_slot: int = 4
    median: int = 128
    sigma: float = 1.0
    max_new_tokens: int = 1024

    def lengths(self, num_requests: int, seed: int) -> list[int]:
        draws = torch.empty(num_requests, dtype=torch.float64)
        draws.log_normal_(math.log(self.median), self.sigma, generator=torch.Generator().manual_seed(seed))
        return draws.round().clamp(1, self.max_new_tokens).long().tolist()


@dataclasses.dataclass(frozen=True)
class LongTailRun:
    """One backend's long-tail call: the workload, its requests' length caps, and the throughput."""

    workload: LongTail
    num_requests: int
    max_new_tokens_sum: int
    """Sum of the drawn caps: the output tokens if no request ends on EOS."""
    throughput: Throughput
    """All requests in one call: the engine refills a slot when its request ends (continuous batching)."""
    in_batches: Throughput
    """The same requests in consecutive calls of ``batch`` each (every call waits for its longest request): what
    the throughput is without refills."""


@dataclasses.dataclass(frozen=True)
class BackendRolloutResult:
    """One backend's measurement in ``bench rollout --backends``."""

    backend: str
    shape: str
    hardware: str
    dtype: str
    batch: int
    prompt_len: int
    new_tokens: int
    startup_s: float
    """Spawn to first ``health`` answer: model load, KV cache, CUDA graphs."""
    engine: Throughput
    """Greedy, log-probs on."""
    engine_sampled: Throughput
    """Temperature 1, top-p 0.95, seeded."""
    bound: BandwidthBound
    fraction_of_bound: float
    long_tail: LongTailRun | None = None
    decode_profile: DecodeProfile | None = None
    """With ``--profile`` (embedded only): decode steps of the sampled call profiled in this process, on an engine
    like the worker's (same model directory, seed and ``max_running_requests``), after the worker has stopped."""


_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of the tensors in ``model_dir``'s safetensors files (a tied embedding is stored once), read
    from their headers without loading them."""
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as checkpoint:
            for name in checkpoint.keys():
                tensor = checkpoint.get_slice(name)
                total += math.prod(tensor.get_shape()) * _DTYPE_BYTES[tensor.get_dtype()]
    return total


ATTENTION_VARIANTS = {"embedded_chunked": ("embedded", "chunked"), "embedded_efficient": ("embedded", "efficient")}
"""Benchmark backend names that are a backend on a given attention kernel family (``BackendSpec.attention_kernel``):
the embedded engine as a ``model.packed_attention`` ``chunked_varlen`` or ``efficient_varlen`` run starts it. A plain
backend name runs the kernels of a run with ``auto``."""


def bench_backend(name: str, dtype: str) -> tuple[str, str]:
    """A benchmark backend name's (registered backend, attention kernel family) for a model in ``dtype``."""
    return ATTENTION_VARIANTS.get(name, (name, engine_kernel_family("auto", dtype)))


def bench_spec(
    name: str, model_dir: Path, dtype: str, base_gpu_id: int, max_running_requests: int | None = None
) -> BackendSpec:
    """The engine a benchmark starts: seed 0, plus the benchmark's server arguments where the backend takes them
    (and ``max_running_requests`` when given)."""
    backend, kernel = bench_backend(name, dtype)
    server_args = dict(BENCH_SERVER_ARGS.get(backend, {}))
    if max_running_requests is not None:
        server_args["max_running_requests"] = max_running_requests
    return BackendSpec(
        backend, str(model_dir), 0, dtype, base_gpu_id=base_gpu_id, server_args=server_args, attention_kernel=kernel
    )


REPEATS = 3
"""Timed calls of a fixed-length cell (greedy, sampled): the cell is their median, so one slow call (a host hiccup on
either backend) does not decide a row. The long tail, 10-20 times longer a call, is timed once."""


def _timed(
    engine, device: torch.device, prompts: list[list[int]], params: dict | list[dict], repeats: int = 1
) -> Throughput:
    """One untimed call (CUDA graphs, JIT), then ``repeats`` timed calls of the same work: the median one's time and
    tokens (those produced), with every call's seconds where there are several."""
    engine.generate(prompts, params)
    calls = []
    for _ in range(repeats):
        with timer(device) as seconds:
            results = engine.generate(prompts, params)
        calls.append((seconds[0], sum(r["completion_tokens"] for r in results)))
    median_s, tokens = sorted(calls)[len(calls) // 2]
    return Throughput.of(median_s, tokens, [s for s, _ in calls] if repeats > 1 else None)


def _in_batches(engine, device: torch.device, prompts: list[list[int]], params: list[dict], batch: int) -> Throughput:
    """``prompts`` in consecutive calls of ``batch`` (warm: the long-tail call ran before), timed together."""
    tokens = 0
    with timer(device) as seconds:
        for start in range(0, len(prompts), batch):
            results = engine.generate(prompts[start : start + batch], params[start : start + batch])
            tokens += sum(r["completion_tokens"] for r in results)
    return Throughput.of(seconds[0], tokens)


def _bench_backend(
    backend: str,
    model_dir: Path,
    run_dir: Path,
    prompts: list[list[int]],
    new_tokens: int,
    dtype: str,
    device: torch.device,
    long_tail: tuple[list[list[int]], list[dict]] | None = None,
) -> tuple[float, dict[str, Throughput]]:
    from rlrun.engine.client import EngineClient

    spec = bench_spec(backend, model_dir, dtype, device.index or 0, max_running_requests=len(prompts))
    with timer(device) as startup_s:
        engine = EngineClient.spawn(spec, run_dir=run_dir, rank=0, startup_timeout_s=600)
    try:
        runs = {}
        for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
            fixed = {"max_new_tokens": new_tokens, "ignore_eos": True, **params}  # every response full length
            runs[name] = _timed(engine, device, prompts, fixed, REPEATS)
        if long_tail is not None:
            runs["long_tail"] = _timed(engine, device, *long_tail)
            runs["long_tail_in_batches"] = _in_batches(engine, device, *long_tail, batch=len(prompts))
    finally:
        engine.shutdown()
    return startup_s[0], runs


def _long_tail_call(
    workload: LongTail, batch: int, prompt_len: int, vocab: int, seed: int
) -> tuple[list[list[int]], list[dict]]:
    """The long-tail call at ``batch`` slots: its prompts and per-request sampling parameters."""
    num_requests = workload.requests_per_slot * batch
    generator = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(2, vocab, (num_requests, prompt_len), generator=generator).tolist()
    lengths = workload.lengths(num_requests, seed)
    params = [{**SAMPLED, "max_new_tokens": n, "sampling_seed": k} for k, n in enumerate(lengths)]
    return prompts, params


def bench_rollout_backends(
    backends: list[str],
    shape: str,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    dtype: str,
    run_dir: Path,
    hbm_bytes_per_s: float | None = None,
    seed: int = 0,
    long_tail: LongTail | None = None,
    profile: Path | None = None,
) -> list[BackendRolloutResult]:
    """Time each backend's worker on the same random model and prompts, one backend at a time, per batch size
    (a fresh worker each, started with ``max_running_requests`` = the batch); ``profile``: also profile the
    embedded engine's decode steps (:func:`_profile_in_process`), tables at :func:`profile_path`."""
    elsewhere = [name for name in backends if not backend_traits(bench_backend(name, dtype)[0]).profiles_in_process]
    if profile is not None and elsewhere:
        raise ValueError(
            f"--profile ({profile}) must run without the backends {','.join(elsewhere)} because the profiler sees "
            "the kernels of this process, and they decode in processes of their own (SGLang: its scheduler); "
            "run them without --profile"
        )
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if hbm_bytes_per_s is None:  # the card's (rollout.py's bound), before any worker starts
        hbm_bytes_per_s = card_hbm_bytes_per_s(hardware(device))
    kv_token_bytes = kv_bytes_per_token(shape, getattr(torch, dtype).itemsize)
    spec = get_shape(shape)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-", dir=run_dir) as tmp:
        model_dir = write_random_model(spec, Path(tmp), getattr(torch, dtype), str(device))
        nbytes = checkpoint_bytes(Path(model_dir))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for batch in batches:
            generator = torch.Generator().manual_seed(seed)
            prompts = torch.randint(2, spec.vocab, (batch, prompt_len), generator=generator).tolist()
            tail = None if long_tail is None else _long_tail_call(long_tail, batch, prompt_len, spec.vocab, seed)
            bound = BandwidthBound.of(nbytes, hbm_bytes_per_s, batch, kv_token_bytes, prompt_len, new_tokens)
            for backend in backends:
                startup_s, runs = _bench_backend(
                    backend, Path(model_dir), run_dir, prompts, new_tokens, dtype, device, tail
                )
                tail_run = None
                if tail is not None:  # built exactly when long_tail is set
                    caps = sum(p["max_new_tokens"] for p in tail[1])
                    tail_run = LongTailRun(
                        long_tail, len(tail[0]), caps, runs["long_tail"], runs["long_tail_in_batches"]
                    )
                decode = None
                if profile is not None:  # only the embedded backend runs with it
                    table = profile_path(profile, batch, batches)
                    decode = _profile_in_process(
                        Path(model_dir), dtype, device, prompts, new_tokens, table, hbm_bytes_per_s, backend
                    )
                results.append(
                    BackendRolloutResult(
                        backend=backend,
                        shape=shape,
                        hardware=hardware(device),
                        dtype=dtype,
                        batch=batch,
                        prompt_len=prompt_len,
                        new_tokens=new_tokens,
                        startup_s=startup_s,
                        engine=runs["greedy"],
                        engine_sampled=runs["sampled"],
                        bound=bound,
                        fraction_of_bound=runs["greedy"].tokens_per_s / bound.tokens_per_s,
                        long_tail=tail_run,
                        decode_profile=decode,
                    )
                )
    return results


def _profile_in_process(
    model_dir: Path,
    dtype: str,
    device: torch.device,
    prompts: list[list[int]],
    new_tokens: int,
    table: Path,
    hbm_bytes_per_s: float,
    name: str = "embedded",
) -> DecodeProfile:
    """The worker's engine (seed 0, ``max_running_requests`` = the batch, benchmark backend ``name``'s attention
    kernel) built in this process, profiled, freed."""
    from rlrun.engine.embedded.engine import EmbeddedEngine

    kernel = bench_backend(name, dtype)[1]
    engine = EmbeddedEngine(
        model_dir, seed=0, dtype=dtype, device=device, max_running_requests=len(prompts), attention_kernel=kernel
    )
    try:
        return profile_decode(engine, prompts, SAMPLED, new_tokens, table, hbm_bytes_per_s)
    finally:
        engine.free_cache()
