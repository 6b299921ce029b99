"""Engine backends: what the worker process drives behind the RPC.

A backend does the work; the worker (``rlrun.engine.worker``) owns the contract's rules
(``rlrun.engine.lifecycle``), so a backend may assume every call it gets is legal. Backend methods
are coroutines run on the worker's event loop (``backend.loop`` when the backend brings its own, as
``sglang.Engine`` does). Backends are imported lazily by name so the worker only pays for (and only
needs) the one it runs; only ``backends.sglang`` imports sglang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Literal, Protocol

from rlrun.engine.sampling import SamplingParams
from rlrun.engine.types import GenResult, OpResult

BACKENDS = ("embedded", "sglang")


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Everything a worker needs to build its backend; crosses to the worker as JSON on its command line."""

    backend: Literal["embedded", "sglang"]
    model_path: str
    seed: int
    dtype: str = "float32"
    base_gpu_id: int = 0
    """GPU index under the (shared) CUDA_VISIBLE_DEVICES: the trainer rank's LOCAL_RANK, so that a
    device index in a CUDA IPC handle means the same GPU on both sides."""
    device: str | None = None
    """Embedded only: None picks ``cuda:<base_gpu_id>`` when CUDA is available, else ``cpu``."""
    tp_size: int = 1
    enable_memory_saver: bool = False
    """SGLang only: wrap weights and KV cache in torch_memory_saver regions so release frees them."""
    server_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """SGLang only: extra ``sglang.Engine`` (ServerArgs) keyword arguments, passed through."""

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

    def shutdown(self) -> None:
        """Called once after the event loop has stopped serving."""


def load_backend(spec: BackendSpec) -> EngineBackend:
    """Build the named backend (importing its module only now)."""
    if spec.backend == "embedded":
        from rlrun.engine.backends.embedded_backend import EmbeddedBackend

        return EmbeddedBackend(spec.model_path, seed=spec.seed, dtype=spec.dtype, device=spec.resolved_device())
    if spec.backend == "sglang":
        from rlrun.engine.backends.sglang import SglangBackend

        return SglangBackend(spec)
    raise ValueError(
        f"engine backend ({spec.backend!r}) must be one of {list(BACKENDS)} because those are "
        "implemented; set engine.backend accordingly"
    )
