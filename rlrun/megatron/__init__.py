"""Megatron side of the trainer: HF -> Megatron models, log-probs, train step, HF weight export.

The names below are imported on first use (PEP 562), so a torch-free module of this package
(``rlrun.megatron.families``, which the preflight reads) is importable without torch; Megatron itself is
imported lazily inside the functions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlrun.megatron.export import export_hf_weights
    from rlrun.megatron.logprobs import compute_logprobs, compute_logprobs_and_entropy
    from rlrun.megatron.model import MegatronModel, build_model
    from rlrun.megatron.train import make_optimizer, make_optimizer_and_scheduler, make_scheduler, train_step

_HOMES = {
    "export_hf_weights": "rlrun.megatron.export",
    "compute_logprobs": "rlrun.megatron.logprobs",
    "compute_logprobs_and_entropy": "rlrun.megatron.logprobs",
    "MegatronModel": "rlrun.megatron.model",
    "build_model": "rlrun.megatron.model",
    "make_optimizer": "rlrun.megatron.train",
    "make_optimizer_and_scheduler": "rlrun.megatron.train",
    "make_scheduler": "rlrun.megatron.train",
    "train_step": "rlrun.megatron.train",
}

__all__ = [
    "MegatronModel",
    "build_model",
    "compute_logprobs",
    "compute_logprobs_and_entropy",
    "export_hf_weights",
    "make_optimizer",
    "make_optimizer_and_scheduler",
    "make_scheduler",
    "train_step",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'rlrun.megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
