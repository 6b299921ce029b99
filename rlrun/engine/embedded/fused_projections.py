"""A layer's query/key/value projections as one GEMM, and its gate/up projections as another.

Why: transformers' decoder layers call ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden states, then
``gate_proj`` and ``up_proj`` on the same input: five GEMMs a layer where two would do. At decode shapes (M = the
batch) each GEMM is small (2-6 MB of weights for Qwen3-0.6B) and runs far from the bandwidth its bytes would
allow (``bench rollout --profile``, docs/engine.md "Where a decode step's time goes"); the trainer already runs
both as single fused GEMMs (Megatron's ``linear_qkv`` and ``linear_fc1``).

How, without copying any family's attention or MLP forward: the projections' weights are concatenated along
their output rows into one parameter (``<module>.qkv_proj`` / ``<module>.gate_up_proj``), and each original
projection becomes a :class:`ProjectionPart`. The first part called on an input computes the whole fused GEMM
and hands back its columns; the other parts called on the same tensor object take their columns of that output;
a part called on another tensor computes its own rows (still correct, just not fused). Each output column is the
same dot product over the same input, so the results equal the unfused GEMMs' wherever the GEMM's reduction
order does not depend on the number of output columns (bitwise on CPU; checked on CUDA by the engine tests).

:func:`fuse_projections` returns where each original weight now lives, so the engine still loads, checksums
and reports weights under their checkpoint names (``EmbeddedEngine.load_weights``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
"""Fused name and the projections it replaces, in row order (each is called on one shared input)."""


@dataclass(frozen=True)
class WeightSlice:
    """Checkpoint tensor ``<module>.<part>.<weight|bias>`` is ``rows`` of parameter ``fused``."""

    fused: str
    rows: slice


class FusedProjection(torch.nn.Module):
    """The concatenated weights (and biases) of a group, and the output of its last fused GEMM until every
    part has taken its columns (then dropped, so no step's activation outlives the forward that made it; the
    transformers families call every part once per forward)."""

    def __init__(self, parts: Sequence[torch.nn.Linear]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.cat([p.weight.data for p in parts]), requires_grad=False)
        self.bias = (
            None
            if parts[0].bias is None
            else torch.nn.Parameter(torch.cat([p.bias.data for p in parts]), requires_grad=False)
        )
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.out_features)
        self.bounds = bounds
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._unserved: set[int] = set()

    def rows(self, index: int) -> slice:
        """Part ``index``'s rows of the fused weight and bias (its columns of the fused output)."""
        return slice(self.bounds[index], self.bounds[index + 1])

    def columns(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part ``index``'s projection of ``x``."""
        rows = self.rows(index)
        if x is not self._input:  # a new input: one GEMM for every part
            self._input, self._output = x, F.linear(x, self.weight, self.bias)
            self._unserved = set(range(len(self.bounds) - 1))
        elif index not in self._unserved:  # this part again on the same input: its own rows alone
            return F.linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])
        out = self._output[..., rows]  # type: ignore[index]  # set together with _input above
        self._unserved.discard(index)
        if not self._unserved:
            self._input = self._output = None
        return out


class ProjectionPart(torch.nn.Module):
    """Stands where ``q_proj`` (or ``k_proj``, ...) stood: its columns of the group's fused GEMM."""

    fused: FusedProjection

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the weights belong to the fused module once
        self.index = index
        self.in_features = fused.weight.shape[1]
        self.out_features = fused.bounds[index + 1] - fused.bounds[index]

    @property
    def weight(self) -> torch.Tensor:
        """This part's rows of the fused weight (a view), for code that reads ``q_proj.weight`` (its dtype, say)."""
        return self.fused.weight[self.fused.rows(self.index)]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.fused.bias
        return None if bias is None else bias[self.fused.rows(self.index)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.columns(self.index, x)


def _fusable(parts: list[object]) -> bool:
    """Plain linears over the same input width, dtype and device, all with a bias or none."""
    if not all(type(p) is torch.nn.Linear for p in parts):
        return False
    linears: list[torch.nn.Linear] = parts  # type: ignore[assignment]  # checked just above
    first = linears[0]
    return all(
        p.in_features == first.in_features
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        and (p.bias is None) == (first.bias is None)
        for p in linears
    )


def fuse_projections(model: torch.nn.Module) -> dict[str, WeightSlice]:
    """Fuse every module's q/k/v and gate/up linears; returns checkpoint name -> slice of a fused parameter."""
    slices: dict[str, WeightSlice] = {}
    for prefix, module in list(model.named_modules()):
        for fused_name, names in GROUPS:
            parts = [getattr(module, n, None) for n in names]
            if hasattr(module, fused_name) or not _fusable(parts):
                continue
            fused = FusedProjection(parts)  # type: ignore[arg-type]  # _fusable checked the types
            module.add_module(fused_name, fused)
            path = f"{prefix}.{fused_name}" if prefix else fused_name
            for index, name in enumerate(names):
                setattr(module, name, ProjectionPart(fused, index))
                rows = fused.rows(index)
                part = f"{prefix}.{name}" if prefix else name
                slices[f"{part}.weight"] = WeightSlice(f"{path}.weight", rows)
                if fused.bias is not None:
                    slices[f"{part}.bias"] = WeightSlice(f"{path}.bias", rows)
    return slices
