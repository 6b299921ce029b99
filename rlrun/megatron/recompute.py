"""Activation recompute (``train.recompute``): which activations the backward pass recomputes instead of keeping.

A transformer layer keeps, per token, its inputs and every intermediate its backward needs; at long
responses these dominate device memory (``rlrun doctor`` estimates them per token: ``rlrun.tools.memory_estimate``).
Megatron's recompute options, on the local spec:

* ``selective``: the core attention and the dense MLP run under ``tensor_parallel.checkpoint``; each keeps
  only its inputs (the query/key/value after RoPE, the pre-MLP norm output) and is run again in the backward.
  rlrun's own core attention (``rlrun.megatron.attention``) is what the core-attention checkpoint wraps, so none
  of its activations (per-sample splits, the kernel's saved output and log-sum-exp) are kept. Costs about one
  extra MLP and attention forward (~25-30% more FLOPs).
* ``full``: whole layers run under the checkpoint and keep only their input hidden states; every layer
  (``num_layers`` None) or the first ``num_layers`` of each pipeline stage. Costs one extra forward (~33%).

MoE layers' experts are not recomputed by ``selective`` (Megatron's ``mlp`` module is the dense MLP only).
The numbers are unchanged: recompute runs the same kernels on the same inputs with the same RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlrun.config.schema import RecomputeMode


@dataclass(frozen=True)
class Recompute:
    """``train.recompute`` and ``train.recompute_num_layers`` as Megatron's ``TransformerConfig`` options."""

    mode: RecomputeMode = "none"
    num_layers: int | None = None
    """``full`` only: layers of each pipeline stage to recompute, from its first; None: all of them."""

    def config_kwargs(self, layers_per_stage: int) -> dict[str, Any]:
        """``recompute_*`` keyword arguments of ``TransformerConfig`` for a stage of ``layers_per_stage`` layers
        (``num_layers`` without ``full`` is refused when the config loads)."""
        if self.mode == "none":
            return {}
        if self.mode == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}
        if self.num_layers is None:
            return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        if self.num_layers > layers_per_stage:
            raise ValueError(
                f"train.recompute_num_layers ({self.num_layers}) must be <= the {layers_per_stage} layers of a "
                "pipeline stage because it counts layers of one stage; lower it or leave it unset (all layers)"
            )
        return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": self.num_layers}
