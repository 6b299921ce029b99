"""Checkpoint names of MoE experts -> slices of transformers 5's fused expert parameters.

Real Qwen3-MoE checkpoints (and what the trainer exports) name each expert's weights separately,
``model.layers.i.mlp.experts.e.{gate,up,down}_proj.weight`` ([I, H], [I, H], [H, I]); transformers 5
holds them fused per layer: ``experts.gate_up_proj [E, 2I, H]`` (gate rows first, then up: the forward
``chunk(2)``s the product in that order) and ``experts.down_proj [E, H, I]``. The engine copies a sent
expert weight into its slice of the fused tensor, as transformers' own loader does from a checkpoint.
"""

from __future__ import annotations

import re

import torch

EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def expert_slice(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a fused parameter that checkpoint weight ``name`` fills, or None if ``name`` is no
    per-expert weight of a fused model."""
    match = EXPERT_WEIGHT.match(name)
    if match is None:
        return None
    experts, expert, proj = match["experts"], int(match["e"]), match["proj"]
    if proj == "down":
        fused = params.get(f"{experts}.down_proj")
        return None if fused is None or expert >= fused.shape[0] else fused[expert]
    fused = params.get(f"{experts}.gate_up_proj")
    if fused is None or expert >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    return fused[expert, :half] if proj == "gate" else fused[expert, half:]
