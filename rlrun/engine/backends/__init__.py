"""Engine backends: what the worker process drives behind the RPC.

A backend does the work; the worker (``rlrun.engine.worker``) owns the contract's rules
(``rlrun.engine.lifecycle``), so a backend may assume every call it gets is legal. Backends are
imported lazily by name so the worker only pays for (and only needs) the one it runs; only a
``sglang`` backend may import sglang.
"""

from __future__ import annotations

from typing import Protocol

from rlrun.engine.types import GenResult

BACKENDS = ("embedded",)


class EngineBackend(Protocol):
    weight_version: str

    def generate(self, input_ids: list[list[int]], sampling_params: dict | list[dict],
                 return_logprob: bool = True, rids: list[str] | None = None) -> list[GenResult]: ...

    def begin_weight_update(self) -> None: ...

    def update_weights_from_tensor(self, payloads: list[bytes], load_format: str,
                                   weight_version: str | None) -> None:
        """Load one payload per TP rank; raise on failure; adopt ``weight_version`` if given."""

    def end_weight_update(self) -> None: ...

    def flush_cache(self) -> None: ...

    def release_memory_occupation(self, tags: list[str]) -> None: ...

    def resume_memory_occupation(self, tags: list[str]) -> None: ...

    def shutdown(self) -> None: ...


def load_backend(name: str, *, model_path: str, seed: int, dtype: str) -> EngineBackend:
    """Build the named backend (importing its module only now)."""
    if name == "embedded":
        from rlrun.engine.backends.embedded import EmbeddedEngine

        return EmbeddedEngine(model_path, seed=seed, dtype=dtype)
    raise ValueError(f"engine backend ({name!r}) must be one of {list(BACKENDS)} because those are implemented; "
                     "set engine.backend accordingly")
