"""What one rank must save to continue training exactly: its model shard, optimizer shard and RNGs.

Every rank saves its own tensor-parallel shard as a plain ``state_dict`` (``torch.save``), so a
checkpoint resumes on the same parallel layout only; :mod:`rlrun.checkpoint` checks that before
loading. The optimizer's state is Megatron's own ``state_dict``: Adam moments and step counts, and
for bf16 models the fp32 main weights, which are the weights the next update starts from.

RNG states are saved although the loop seeds its sampling per step: dropout (off today), user
reward functions and Megatron's model-parallel RNG tracker draw from them.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch

from rlrun.megatron.model import MegatronModel

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer


def rank_state(model: MegatronModel, optimizer: MegatronOptimizer) -> dict[str, Any]:
    """This rank's shards and RNG states. The tensors alias live ones: copy them before training on."""
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "rng": _rng_state()}


def load_rank_state(model: MegatronModel, optimizer: MegatronOptimizer, state: dict[str, Any]) -> None:
    """Restore what :func:`rank_state` returned (after ``build_model`` and ``make_optimizer``)."""
    load_model_shard(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])


def load_model_shard(model: MegatronModel, model_state: dict[str, Any]) -> None:
    """Copy a saved ``rank_state(...)["model"]`` into the live weights (every parameter must match)."""
    result = model.module.load_state_dict(model_state, strict=False)
    problems = [key for key in [*result.missing_keys, *result.unexpected_keys] if not key.endswith("_extra_state")]
    if problems:
        raise RuntimeError(f"checkpoint model shard does not match the model built from model.path: "
                           f"missing {result.missing_keys}, unexpected {result.unexpected_keys}; use "
                           f"the model.path the checkpoint was written with")


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "megatron_tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants the nested tuples back that a round trip may have made lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
