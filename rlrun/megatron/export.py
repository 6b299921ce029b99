"""Full HF-named tensors from a TP- and PP-sharded Megatron model, for weight sync and checkpoint export.

Every rank yields the whole model (each rank drives its own engine). Every rank of a pipeline must
iterate the generator in lockstep: each parameter is one all-gather over its stage's TP group and,
with PP > 1, one broadcast from its stage over the pipeline group (preceded by one broadcast of the
stage's names, shapes and dtypes). MoE experts are gathered over the expert-TP group, then over the
expert-parallel group. DP replicas hold identical weights and need no communication.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlrun.megatron.hf_weights import to_hf, weight_mappings
from rlrun.megatron.model import MegatronModel
from rlrun.megatron.moe import is_expert_param
from rlrun.megatron.tp_layout import Partition


@torch.no_grad()
def export_hf_weights(model: MegatronModel, fresh: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` in HF checkpoint order, in the model's dtype, with the vocabulary
    and attention-head padding cut off: names and shapes are exactly the HF checkpoint's.

    Tied models yield ``model.embed_tokens.weight`` only (no ``lm_head.weight``), like their safetensors.
    With ``fresh`` the tensors are contiguous copies on the model's device that the caller may keep or move.
    Without, a tensor the model holds whole (no TP shards to gather) comes as a view of the live parameter, possibly
    strided, valid until the next update: what a weight sync wants, which copies each tensor into its bucket anyway
    (a copy here would move every byte of an 8B model twice more). With LoRA (``model.lora``) the targeted weights are
    merged, ``W + scale * B A``, so the engine needs no adapter support.
    """
    if model.parallel.pp_size == 1:
        yield from _stage_tensors(model, fresh)
        return
    for stage in range(model.parallel.pp_size):
        yield from _broadcast_stage(model, stage, fresh)


def _stage_tensors(model: MegatronModel, fresh: bool, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's pipeline stage as HF tensors, TP shards gathered; with EP > 1, each layer's routed
    experts gathered from every EP rank (rank ``r``'s block after rank ``r - 1``'s: HF expert order).

    ``fresh``: as :func:`export_hf_weights`. ``meta``: no communication, meta tensors of the right shapes (what the
    other stages must receive).
    """
    params = {**dict(model.module.named_buffers()), **dict(model.module.named_parameters())}  # mapped buffers too
    parallel = model.parallel
    per_rank = [
        weight_mappings(model.arch, parallel.pp_rank, parallel.pp_size, r, parallel.ep_size)
        for r in range(parallel.ep_size)
    ]
    mine = per_rank[parallel.ep_rank]
    indexed = [(i, m) for i, m in enumerate(mine) if m.exported]
    for experts, group in itertools.groupby(indexed, key=lambda item: is_expert_param(item[1].megatron_name)):
        gathered = [(i, _gather(model, m.megatron_name, params[m.megatron_name], experts, meta)) for i, m in group]
        ranks = range(parallel.ep_size) if experts else [parallel.ep_rank]
        for rank in ranks:
            for i, fulls in gathered:
                mapping = per_rank[rank][i]
                full = fulls[rank] if experts else fulls[0]
                hf = to_hf(model.arch, mapping, full)
                if fresh:
                    hf = [_fresh(t, params[mapping.megatron_name]) for t in hf]
                yield from zip(mapping.hf_names, hf, strict=False)


def _fresh(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous tensor of its own: one copy where it views the live ``param`` or is strided, none
    where it is already a gathered (or merged) copy."""
    if tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.contiguous()


def _gather(model: MegatronModel, name: str, param: torch.Tensor, expert: bool, meta: bool) -> list[torch.Tensor]:
    """The full (TP-, or for experts ETP-, gathered) tensor of parameter ``name``; for experts one per EP rank."""
    from megatron.core import parallel_state as mpu

    parallel = model.parallel
    partition = Partition.of(param)
    size = parallel.etp_size if expert else parallel.tp_size
    if meta:
        shape = list(param.shape)
        if partition.dim is not None:
            shape[partition.dim] *= size
        return [torch.empty(shape, dtype=param.dtype, device="meta")] * (parallel.ep_size if expert else 1)
    # The shard as the engine must get it: with LoRA, its adapters merged in (a fresh tensor).
    local = model.lora.merged(name, param) if model.lora is not None else param
    if partition.dim is not None and size > 1:
        group = mpu.get_expert_tensor_parallel_group() if expert else mpu.get_tensor_model_parallel_group()
        full = partition.gather(local.detach(), size, group)
    else:
        full = local.detach()  # the live parameter, or LoRA's merged copy
    if not expert or parallel.ep_size == 1:
        return [full]
    fulls = [torch.empty_like(full) for _ in range(parallel.ep_size)]
    dist.all_gather(fulls, full, group=mpu.get_expert_model_parallel_group())
    return fulls


def _broadcast_stage(model: MegatronModel, stage: int, fresh: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage ``stage``'s HF tensors on every rank of the pipeline, one broadcast per tensor (``fresh``: as
    :func:`export_hf_weights`; a broadcast needs contiguous memory, so the owner's views are made so)."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_pipeline_model_parallel_group()
    owner = model.parallel.pp_rank == stage
    specs = [_stage_specs(model) if owner else None]
    dist.broadcast_object_list(specs, group=group, group_src=stage)
    local = _stage_tensors(model, fresh) if owner else None
    for name, shape, dtype in specs[0]:
        if local is not None:
            _, tensor = next(local)
            tensor = tensor.contiguous()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=model.parallel.device)
        dist.broadcast(tensor, group=group, group_src=stage)
        yield name, tensor


def _stage_specs(model: MegatronModel) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(HF name, shape, dtype) of what ``_stage_tensors`` yields, worked out on meta tensors."""
    return [(name, t.shape, t.dtype) for name, t in _stage_tensors(model, fresh=False, meta=True)]
