"""Where the run's prompts come from: the seeded :class:`PromptSampler`, or a data source of your own
(``data.sampler``, slime's ``--data-source-path``), built on rank 0 from the tokenized dataset::

    def make(dataset: PromptDataset, seed: int, shuffle: bool) -> PromptSource

A source is what every sampling round draws from and what checkpoints save (``state_dict()`` must be
JSON values: it goes into ``run_state.json``; ``load_state_dict`` must continue the exact sequence, or a
resumed run repeats or skips prompts). Example: examples/hooks/sources.py (round-robin over data sources).
"""

from __future__ import annotations

from typing import Any, Protocol

from rlrun.config.schema import DataConfig
from rlrun.data.prompts import PromptDataset, PromptSampler
from rlrun.data.sample import Prompt
from rlrun.runtime.hooks import load_hook

SIGNATURE = "fn(dataset: PromptDataset, seed: int, shuffle: bool) -> PromptSource"
_MEMBERS = ("dataset", "next_batch", "state_dict", "load_state_dict")


class PromptSource(Protocol):
    """What the rollout and the checkpoint need of a prompt source (:class:`PromptSampler` is one)."""

    dataset: PromptDataset

    def next_batch(self, n: int) -> list[Prompt]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def load_source_factory(spec: str):
    """The ``data.sampler`` factory; errors name the key, the path and :data:`SIGNATURE`."""
    return load_hook(spec, "data.sampler", SIGNATURE, num_args=3)


def build_source(cfg: DataConfig, dataset: PromptDataset, seed: int) -> PromptSource:
    """``data.sampler``'s source over ``dataset``, or the seeded :class:`PromptSampler` when unset."""
    if cfg.sampler is None:
        return PromptSampler(dataset, seed=seed, shuffle=cfg.shuffle)
    source = load_source_factory(cfg.sampler)(dataset, seed, cfg.shuffle)
    missing = [name for name in _MEMBERS if not hasattr(source, name)]
    if missing:
        raise ValueError(
            f"data.sampler ('{cfg.sampler}') must return an object with {', '.join(_MEMBERS)} because rounds "
            f"draw from it and checkpoints save its state; it returned a {type(source).__name__} without {missing}"
        )
    return source
