"""Engine backends: what the worker process drives behind the RPC, and what each one can do.

A backend does the work; the worker (``rlrun.engine.worker``) owns the contract's rules
(``rlrun.engine.lifecycle``, docs/engine-contract.md), so a backend may assume every call it gets is
legal. Backend methods are coroutines run on the worker's event loop (``backend.loop`` when the backend
brings its own, as ``sglang.Engine`` does).

``BACKENDS`` describes each backend by its traits; the rest of rlrun reads traits, never names. A backend
is built in the worker from its ``factory`` path, imported only there, so the trainer pays for (and
needs) none of them; only ``backends.sglang`` imports sglang. This module imports no torch at load
(the config schema validates ``engine.*`` against ``BACKENDS``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from rlrun.engine.types import GenResult, OpResult

if TYPE_CHECKING:
    from rlrun.config.schema import RunConfig
    from rlrun.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class BackendTraits:
    """What the trainer may rely on of a backend."""

    factory: str
    """``module:callable`` that builds the backend from a :class:`BackendSpec`, imported in the worker."""
    shards_over_tp: bool
    """``engine.tp > 1`` splits the engine over the group's GPUs (one weight payload per engine TP rank);
    otherwise one unsharded engine on the leader's device serves the group."""
    supports_checksums: bool
    """Answers ``weight_checksums`` (``engine.verify_weights``)."""
    accepts_server_args: bool
    """Reads ``engine.server_args`` (passed through, checked by the backend)."""
    routed_experts_args: Mapping[str, Any] | None
    """Server arguments under which it returns each sample's routed experts (``algorithm.routing_replay:
    rollout``); ``{}``: it always does for MoE models; None: it cannot."""
    scores_any_temperature: bool = True
    """``score_tokens`` honours its temperature; False: it scores at 1 whatever it is asked (SGLang's prompt
    log-probs at T = 0.7 equal its T = 1 ones: tests/gpu/test_sglang_gpu.py), so an engine teacher
    refuses another rollout temperature."""
    server_arg_names: tuple[str, ...] | None = None
    """The ``engine.server_args`` keys it reads, checked when the config loads (None: any, e.g. every
    ``sglang.Engine`` argument)."""
    needs_gpu: bool = False
    kv_pool_fraction_arg: str | None = None
    """The server argument that sizes its weights and KV cache together as a fraction of the device (``rlrun
    doctor``'s per-phase estimate, rlrun/tools/phase_memory.py); None: the KV cache is sized to each generate call."""
    package: str | None = None
    """The distribution it imports (``rlrun doctor`` checks it is installed)."""
    profiles_in_process: bool = False
    """Its engine is rlrun's ``EmbeddedEngine``, which ``rlrun bench rollout --profile`` builds and steps in the
    bench's own process (the profiler sees only that process's kernels; SGLang decodes in its scheduler's)."""
    worker_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Variables its worker process starts with, over the trainer's environment (``BackendSpec.worker_env``;
    ``EngineClient.spawn``'s ``extra_env`` over these)."""


EXACT_GEMM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}
"""The embedded worker's cuBLAS has no workspace, so no split-K kernel: a decode batch's rows of every projection then
round as the trainer's rows of the same tokens do. With the default workspace the down projection at decode batch sizes
is a split-K kernel that rounds apart; without one every projection is bitwise, for a few microseconds a GEMM
(BENCHMARKS.md, "Embedded engine against SGLang": the decode GEMMs; docs/on_policy.md). cuBLAS reads it when the process
first uses it, hence an environment variable."""

BACKENDS: dict[str, BackendTraits] = {
    "embedded": BackendTraits(
        factory="rlrun.engine.embedded.backend:EmbeddedBackend.from_spec",
        shards_over_tp=False,
        supports_checksums=True,
        accepts_server_args=True,
        server_arg_names=("max_running_requests", "chunked_prefill_size", "session_cache_size"),
        routed_experts_args={},
        profiles_in_process=True,
        worker_env=EXACT_GEMM_ENV,
    ),
    "sglang": BackendTraits(
        factory="rlrun.engine.backends.sglang:SglangBackend",
        shards_over_tp=True,
        supports_checksums=False,  # sglang.Engine offers no per-tensor weight access
        accepts_server_args=True,
        routed_experts_args={"enable_return_routed_experts": True},
        scores_any_temperature=False,
        needs_gpu=True,
        kv_pool_fraction_arg="mem_fraction_static",
        package="sglang",
    ),
}


def register_backend(name: str, traits: BackendTraits) -> None:
    """Add a backend (a new engine, or a test's): its ``factory`` must be importable in the worker too."""
    if name in BACKENDS:
        raise ValueError(f"engine backend {name!r} is already registered; pick another name")
    BACKENDS[name] = traits


def backend_traits(name: str) -> BackendTraits:
    if name not in BACKENDS:
        raise ValueError(
            f"engine.backend ({name!r}) must be one of {sorted(BACKENDS)} because those are registered; "
            "set engine.backend accordingly"
        )
    return BACKENDS[name]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Everything a worker needs to build its backend; crosses to the worker as JSON on its command line."""

    backend: str
    model_path: str
    seed: int
    dtype: str = "float32"
    base_gpu_id: int | None = None
    """GPU index under the (shared) CUDA_VISIBLE_DEVICES: the trainer rank's LOCAL_RANK (None: read it
    from the environment), so that a device index in a CUDA IPC handle means the same GPU on both sides."""
    device: str | None = None
    """Unsharded backends: None picks ``cuda:<base_gpu_id>`` when CUDA is available, else ``cpu``."""
    tp_size: int = 1
    """Engine TP ranks; more than 1 only for backends that shard over TP."""
    enable_memory_saver: bool = False
    """Wrap weights and KV cache in torch_memory_saver regions so release frees them (``offload.rollout``)."""
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra backend keyword arguments (``engine.server_args`` plus what the run needs), passed through."""
    attention_kernel: str = "efficient"
    """The trainer's attention kernel family, which the embedded engine runs too
    (``rlrun.kernels.attention.engine_kernel_family``: ``chunked`` when the trainer runs ``chunked_varlen``, which
    ``auto`` is on CUDA in bfloat16); other backends run their own kernels."""
    factory: str = ""
    """The backend's ``BackendTraits.factory`` (filled from ``BACKENDS``): the worker process imports it
    without having to know the trainer's registrations."""
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)
    """The backend's ``BackendTraits.worker_env``, filled with ``factory`` (so a process that spawns a worker
    from a spec needs no registration either)."""

    def __post_init__(self) -> None:
        if not self.factory:
            traits = backend_traits(self.backend)
            object.__setattr__(self, "factory", traits.factory)
            object.__setattr__(self, "worker_env", {**traits.worker_env, **self.worker_env})
        if self.base_gpu_id is None:
            object.__setattr__(self, "base_gpu_id", int(os.environ.get("LOCAL_RANK", 0)))

    @classmethod
    def from_config(cls, cfg: RunConfig, *, seed: int) -> BackendSpec:
        """The run's engine (``engine.*``, ``model.*``, ``offload.rollout``) plus the server arguments its
        algorithm needs: routing replay of the engine's experts asks the backend to return them."""
        from rlrun.kernels.attention import engine_kernel_family  # torch: only where a run starts an engine

        traits = backend_traits(cfg.engine.backend)
        server_args = dict(cfg.engine.server_args)
        if cfg.algorithm.routing_replay == "rollout":
            server_args.update(traits.routed_experts_args or {})
        return cls(
            backend=cfg.engine.backend,
            model_path=cfg.model.path,
            seed=seed,
            dtype=cfg.model.dtype,
            enable_memory_saver=cfg.offload.rollout,
            server_args=server_args,
            attention_kernel=engine_kernel_family(cfg.model.packed_attention, cfg.model.dtype, cfg.parallel.cp),
        )

    @property
    def traits(self) -> BackendTraits:
        return backend_traits(self.backend)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BackendSpec:
        return cls(**json.loads(text))

    def resolved_device(self) -> str:
        import torch

        if self.device is not None:
            return self.device
        return f"cuda:{self.base_gpu_id}" if torch.cuda.is_available() else "cpu"


class EngineBackend(Protocol):
    tp_size: int
    loop: asyncio.AbstractEventLoop | None

    @property
    def weight_version(self) -> str: ...

    async def generate(
        self, input_ids: list[list[int]], params: list[SamplingParams], return_logprob: bool, rids: list[str]
    ) -> list[GenResult]:
        """Prompt-major results; sample j of prompt i has rid ``rids[i]`` (n == 1) or ``f"{rids[i]}-{j}"``."""

    async def abort(self, rid: str, abort_all: bool) -> None:
        """Abort in-flight samples whose rid starts with ``rid`` (or all): they return partial output."""

    async def pause_generation(self, mode: str) -> None:
        """``abort``: abort everything in flight; ``in_place``/``retract``: hold it until continue."""

    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> OpResult: ...

    async def release_memory_occupation(self, tags: list[str]) -> None: ...

    async def resume_memory_occupation(self, tags: list[str]) -> None: ...

    async def begin_weight_update(self) -> OpResult: ...

    async def update_weights_from_tensor(
        self, payloads: list[bytes], load_format: str, weight_version: str | None
    ) -> OpResult:
        """Load one payload per TP rank; adopt ``weight_version`` if given and the load succeeded."""

    async def end_weight_update(self) -> OpResult: ...

    async def weight_checksums(self) -> dict[str, str]:
        """sha256 of every weight's bytes by HF name (debug: verify a sync)."""

    async def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float
    ) -> list[list[float]]:
        """Log-probs of each sequence's tokens from ``starts[i]`` on given those before (a teacher's scores)."""

    def shutdown(self) -> None:
        """Called once after the event loop has stopped serving."""


def load_backend(spec: BackendSpec) -> EngineBackend:
    """Build the backend from ``spec.factory`` (importing its module only now, in the worker)."""
    module, _, attr = spec.factory.partition(":")
    factory: Any = importlib.import_module(module)
    for name in attr.split("."):
        factory = getattr(factory, name)
    return factory(spec)
