"""LoRA adapters on the Megatron model's attention and MLP linears, TP-sharded; the base weights frozen.

Each targeted HF projection ``t`` (``model.lora.target_modules``) gets ``A_t`` ``[rank, in]`` and ``B_t``
``[out, rank]`` (PEFT's ``lora_A`` / ``lora_B``) and adds ``scale * B_t A_t x`` to its output, ``scale = alpha / rank``
(arXiv 2106.09685). Megatron fuses the projections, so each fused linear carries the branches of its parts:

===============  ========================  ==========  ========================================================
Megatron linear  HF projections             TP split    the adapters' shards
===============  ========================  ==========  ========================================================
linear_qkv       q_proj, k_proj, v_proj     column      A replicated, B by output rows (the rank's query groups)
linear_proj      o_proj                     row         A by input columns, B replicated
linear_fc1       gate_proj, up_proj         column      A replicated, B by output rows
linear_fc2       down_proj                  row         A by input columns, B replicated
===============  ========================  ==========  ========================================================

Column-parallel branch: ``h = A x`` is complete on every rank and enters Megatron's
``copy_to_tensor_model_parallel_region`` (identity forward, TP all-reduce backward), so ``A``'s gradient and
the branch's input gradient are the whole model's on every rank; ``B h`` gives this rank's output rows, laid
out like the base's (``linear_qkv``: per query group its q, k, v rows; ``linear_fc1``: ``[gate; up]``).
Row-parallel branch: ``h = reduce_from_tensor_model_parallel_region(A_r x_r)`` sums the input shards' parts
(the rank dimension only: ``rank`` numbers per token instead of ``out``), then ``B h`` is replicated like
the base's output. So TP=2 computes what TP=1 does, and the replicated halves get identical gradients.

Parameters live beside the linears, as ``<parent>.lora.<hf projection>.lora_{A,B}`` (``parent`` is
``self_attention`` or ``mlp``): a linear's own checkpoint state knows only its weight and bias.
``A`` starts as PEFT's (uniform in ``±1/sqrt(in)``, drawn from the full matrix with a generator seeded by
``train.seed``, the layer and the projection, so every layout starts from the same adapters) and ``B`` at
zero, so the model starts as the base. Every base parameter gets ``requires_grad=False``: Megatron's DDP
gives it no gradient buffer, its optimizer no fp32 main weight nor Adam moments, and its linears take the
frozen-weight path (no weight gradient).

Adapters off (:meth:`LoraAdapters.disabled`) is the base model: the KL reference (rlrun/trainer/roles.py).
The engine gets merged weights, ``W + scale * B A`` per shard (:meth:`LoraAdapters.merged`), so any engine
serves them. Dropout (PEFT's, on the branch input) applies only in forwards that build a graph: the
no-grad old-policy and reference forwards are the deterministic model the engine samples.

Not supported (refused when the model is built): MoE layers, multi-latent attention, and attention-head
padding (``parallel.tp`` not dividing the KV heads: an inert head would come alive through ``A_o``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from rlrun.megatron.hf_config import ModelArch
from rlrun.megatron.tp_layout import Partition
from rlrun.runtime.dist import Parallel

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

    from rlrun.config.schema import LoraConfig


@dataclass(frozen=True)
class Target:
    """Where one HF projection lives in a Megatron layer."""

    parent: Literal["self_attention", "mlp"]
    linear: str
    parallel: Literal["column", "row"]
    hf_module: str
    """The HF module path under ``model.layers.<i>.`` (PEFT's key names)."""


TARGETS: dict[str, Target] = {
    "q_proj": Target("self_attention", "linear_qkv", "column", "self_attn.q_proj"),
    "k_proj": Target("self_attention", "linear_qkv", "column", "self_attn.k_proj"),
    "v_proj": Target("self_attention", "linear_qkv", "column", "self_attn.v_proj"),
    "o_proj": Target("self_attention", "linear_proj", "row", "self_attn.o_proj"),
    "gate_proj": Target("mlp", "linear_fc1", "column", "mlp.gate_proj"),
    "up_proj": Target("mlp", "linear_fc1", "column", "mlp.up_proj"),
    "down_proj": Target("mlp", "linear_fc2", "row", "mlp.down_proj"),
}
"""Every LoRA target, in the order of its fused linear's output parts (``model.lora.target_modules``' values)."""
PARTS = {linear: [n for n, t in TARGETS.items() if t.linear == linear] for linear in ("linear_qkv", "linear_fc1")}
"""The output parts of the column-parallel fused linears, in their layout order."""


def is_lora_param(megatron_name: str) -> bool:
    """Whether a parameter is a LoRA branch's (no HF tensor maps it)."""
    return ".lora." in megatron_name


class LoraBranch(torch.nn.Module):
    """``lora_A`` / ``lora_B`` of one projection on this rank, and their TP split."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, parallel: Literal["column", "row"], tp_size: int) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.lora_A = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Parameter(b)
        self.parallel = parallel
        self.sharded = "lora_B" if parallel == "column" else "lora_A"
        """The parameter split over TP (the other is replicated)."""
        self.sharded_dim = 0 if parallel == "column" else 1
        if tp_size > 1:  # Megatron counts a replicated parameter once in the grad norm (rank 0's)
            set_tensor_model_parallel_attributes(getattr(self, self.sharded), True, self.sharded_dim, 1)

    def hidden(self, x: torch.Tensor, dropout: float) -> torch.Tensor:
        """``A x`` (summed over TP ranks for a row-parallel branch), the input of ``B`` on every rank."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if dropout > 0 and torch.is_grad_enabled():
            # As Megatron's own dropouts: a replicated input (column) draws from the default generator, the
            # same on every TP rank; a TP-sharded one (row) from the model-parallel generator, one per rank.
            with contextlib.nullcontext() if self.parallel == "column" else get_cuda_rng_tracker().fork():
                x = torch.nn.functional.dropout(x, dropout)
        h = torch.nn.functional.linear(x, self.lora_A)
        if self.parallel == "column":
            return copy_to_tensor_model_parallel_region(h)
        return reduce_from_tensor_model_parallel_region(h)

    def delta(self, x: torch.Tensor, dropout: float) -> torch.Tensor:
        """``B A x``: this rank's output columns (column-parallel) or the whole output (row-parallel)."""
        return torch.nn.functional.linear(self.hidden(x, dropout), self.lora_B)

    def weight_delta(self) -> torch.Tensor:
        """``B A`` in fp32: this rank's rows (column) or columns (row) of the projection's weight change."""
        return self.lora_B.detach().float() @ self.lora_A.detach().float()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron checkpoint entries: the sharded parameter with its TP axis, the other replicated."""
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {self.sharded: self.sharded_dim},
            sharded_offsets,
            tp_group=mpu.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )


class LoraBranches(torch.nn.ModuleDict):
    """One parent's branches by HF projection name (``self_attention.lora`` / ``mlp.lora``)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        out: dict = {}
        for name, branch in self.items():
            out.update(branch.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return out


class LoraAdapters:
    """Every branch of this rank's model, the fused-layout bookkeeping, and the on/off switch."""

    def __init__(self, cfg: LoraConfig, arch: ModelArch, parallel: Parallel) -> None:
        self.cfg = cfg
        self.arch = arch
        self.parallel = parallel
        self.first_layer = parallel.pp_rank * (arch.num_layers // parallel.pp_size)
        """The global index of this pipeline stage's first layer."""
        self.scale = cfg.scale
        self.enabled = True
        self.layers: list[dict[str, LoraBranch]] = []
        """Per local layer: HF projection -> branch."""

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within: the base model (every branch skipped)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def peft_tensors(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``(PEFT key, parameter)`` of this rank's branches, in layer order."""
        for local, branches in enumerate(self.layers):
            for name, branch in branches.items():
                base = f"base_model.model.model.layers.{self.first_layer + local}.{TARGETS[name].hf_module}"
                yield f"{base}.lora_A.weight", branch.lora_A
                yield f"{base}.lora_B.weight", branch.lora_B

    def merged(self, megatron_name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (this rank's shard of ``megatron_name``) plus ``scale * B A`` of its branches, as a
        fresh tensor of its dtype; ``weight`` itself when no branch targets it."""
        parts = megatron_name.split(".")  # decoder.layers.<i>.<parent>.<linear>.weight
        if len(parts) != 6 or parts[:2] != ["decoder", "layers"] or parts[5] != "weight":
            return weight
        branches = self.layers[int(parts[2])]
        linear = parts[4]
        names = [n for n, t in TARGETS.items() if t.linear == linear and t.parent == parts[3]]
        if not any(n in branches for n in names):
            return weight
        if linear in PARTS:
            deltas = [branches[n].weight_delta() if n in branches else None for n in names]
            delta = self._fused(deltas, weight.shape[0], dim=0)
        else:
            delta = branches[names[0]].weight_delta()
        return (weight.detach().float() + self.scale * delta).to(weight.dtype)

    def column_output(self, linear: str, branches: LoraBranches, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` of a column-parallel fused linear plus its branches' deltas in its layout."""
        deltas = [branches[n].delta(x, self.cfg.dropout) if n in branches else None for n in PARTS[linear]]
        return out + self.scale * self._fused(deltas, out.shape[-1], dim=out.dim() - 1)

    def _fused(self, deltas: list[torch.Tensor | None], size: int, dim: int) -> torch.Tensor:
        """The parts' deltas (None: a part without a branch, zero) laid out along ``dim`` like the fused
        linear's local output: ``[gate; up]``, or per query group its q, k and v rows."""
        if len(deltas) == 2:
            widths, groups = [size // 2] * 2, 1
        else:
            hd, groups = self.arch.head_dim, self.arch.num_kv_heads // self.parallel.tp_size
            widths = [self.arch.heads_per_group * hd, hd, hd]
        ref = next(d for d in deltas if d is not None)
        shape = list(ref.shape)
        pieces = []
        for delta, width in zip(deltas, widths, strict=True):
            if delta is None:
                shape[dim] = groups * width
                delta = ref.new_zeros(shape)
            pieces.append(delta.unflatten(dim, (groups, width)))
        return torch.cat(pieces, dim=dim + 1).flatten(dim, dim + 1)


def attach_lora(gpt: GPTModel, arch: ModelArch, cfg: LoraConfig, parallel: Parallel, seed: int) -> LoraAdapters:
    """Freeze every parameter of ``gpt`` and add the configured branches (trainable) to each of its layers,
    with forward hooks on the targeted linears. Call before the DDP wrap and the optimizer."""
    _check_supported(arch, parallel)
    assert not gpt.config.sequence_parallel, "the branches read the whole sequence; rlrun runs without SP"
    for param in gpt.parameters():
        param.requires_grad_(False)
    adapters = LoraAdapters(cfg, arch, parallel)
    for local, layer in enumerate(gpt.decoder.layers):
        branches: dict[str, LoraBranch] = {}
        for parent_name in ("self_attention", "mlp"):
            parent = getattr(layer, parent_name)
            names = [n for n in cfg.target_modules if TARGETS[n].parent == parent_name]
            if not names:
                continue
            group = LoraBranches(
                {
                    n: _new_branch(parent, n, cfg.rank, arch, parallel, _seed(seed, adapters.first_layer + local, n))
                    for n in names
                }
            )
            parent.lora = group
            branches.update(group.items())
            for linear in sorted({TARGETS[n].linear for n in names}):
                getattr(parent, linear).register_forward_hook(_hook(adapters, linear, group))
        adapters.layers.append(branches)
    return adapters


def _check_supported(arch: ModelArch, parallel: Parallel) -> None:
    if arch.moe is not None or arch.mla is not None:
        raise ValueError(
            f"model.lora must be unset for {arch.model_type} because LoRA targets dense attention and MLP "
            "linears (q/k/v/o, gate/up/down), not experts or multi-latent attention; unset model.lora"
        )
    if arch.padded_num_kv_heads(parallel.tp_size) != arch.num_kv_heads:
        raise ValueError(
            f"parallel.tp ({parallel.tp_size}) must divide the KV heads ({arch.num_kv_heads}) with model.lora "
            "because the padded inert heads would come alive through the o_proj adapter; set parallel.tp to a "
            "divisor of the KV heads"
        )


def _seed(seed: int, layer: int, name: str) -> int:
    """The init seed of one branch: the same on every rank and layout."""
    return (seed * 1_000_003 + layer * 31 + list(TARGETS).index(name)) % 2**63


def _new_branch(
    parent: torch.nn.Module, name: str, rank: int, arch: ModelArch, parallel: Parallel, seed: int
) -> LoraBranch:
    """A branch for projection ``name`` of ``parent``'s fused linear: ``A`` this rank's share of the full
    PEFT init, ``B`` zeros of this rank's rows."""
    target = TARGETS[name]
    weight = getattr(parent, target.linear).weight
    tp = parallel.tp_size
    if target.parallel == "column":
        in_full, out_local = weight.shape[1], _part_rows(arch, name, weight.shape[0], tp)
    else:
        in_full, out_local = weight.shape[1] * tp, weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    a_full = (torch.rand(rank, in_full, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(in_full)
    a = a_full if target.parallel == "column" else Partition(1, 1).shard(a_full, parallel.tp_rank, tp)
    like = dict(dtype=weight.dtype, device=weight.device)
    return LoraBranch(a.to(**like).contiguous(), torch.zeros(out_local, rank, **like), target.parallel, tp)


def _part_rows(arch: ModelArch, name: str, local_rows: int, tp: int) -> int:
    """This rank's output rows of projection ``name`` in its column-parallel fused linear."""
    if name in ("gate_proj", "up_proj"):
        return local_rows // 2
    head_rows = arch.num_kv_heads // tp * arch.head_dim  # one head per local query group
    return head_rows * arch.heads_per_group if name == "q_proj" else head_rows


def _hook(adapters: LoraAdapters, linear: str, branches: LoraBranches):
    """The forward hook adding ``linear``'s branches to its ``(output, bias)``."""

    column = linear in PARTS  # fixed per hook: worked out once, not on every forward
    row_branch = None if column else next(branches[n] for n in branches if TARGETS[n].linear == linear)

    def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        if not adapters.enabled:
            return None
        out, bias = output
        x = args[0]
        if row_branch is None:
            return adapters.column_output(linear, branches, x, out), bias
        return out + adapters.scale * row_branch.delta(x, adapters.cfg.dropout), bias

    return hook
