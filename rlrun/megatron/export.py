"""Full HF-named tensors from a TP- and PP-sharded Megatron model, for weight sync and checkpoint export.

Every rank yields the whole model (each rank drives its own engine). Every rank of a pipeline must
iterate the generator in lockstep: each parameter is one all-gather over its stage's TP group and,
with PP > 1, one broadcast from its stage over the pipeline group (preceded by one broadcast of the
stage's names, shapes and dtypes). DP replicas hold identical weights and need no communication.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlrun.megatron.hf_weights import to_hf, weight_mappings
from rlrun.megatron.model import MegatronModel
from rlrun.megatron.tp_layout import Partition


@torch.no_grad()
def export_hf_weights(model: MegatronModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` in HF checkpoint order, in the model's dtype, with the vocabulary
    and attention-head padding cut off: names and shapes are exactly the HF checkpoint's.

    Tied models yield ``model.embed_tokens.weight`` only (no ``lm_head.weight``), like their safetensors.
    The tensors are fresh copies on the model's device; the caller may keep or move them.
    """
    if model.parallel.pp_size == 1:
        yield from _stage_tensors(model)
        return
    for stage in range(model.parallel.pp_size):
        yield from _broadcast_stage(model, stage)


def _stage_tensors(model: MegatronModel) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's pipeline stage as HF tensors, TP shards gathered."""
    from megatron.core import parallel_state as mpu

    params = dict(model.module.named_parameters())
    tp_group = mpu.get_tensor_model_parallel_group()
    for mapping in _exported_mappings(model):
        param = params[mapping.megatron_name]
        partition = Partition.of(param)
        if partition.dim is None or model.parallel.tp_size == 1:
            full = param.detach().clone()
        else:
            shards = [torch.empty_like(param) for _ in range(model.parallel.tp_size)]
            dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
            full = partition.unshard(shards)
        yield from zip(mapping.hf_names, (t.contiguous() for t in to_hf(model.arch, mapping, full)))


def _broadcast_stage(model: MegatronModel, stage: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage ``stage``'s HF tensors on every rank of the pipeline, one broadcast per tensor."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_pipeline_model_parallel_group()
    owner = model.parallel.pp_rank == stage
    specs = [_stage_specs(model) if owner else None]
    dist.broadcast_object_list(specs, group=group, group_src=stage)
    local = _stage_tensors(model) if owner else None
    for name, shape, dtype in specs[0]:
        if local is not None:
            _, tensor = next(local)
        else:
            tensor = torch.empty(shape, dtype=dtype, device=model.parallel.device)
        dist.broadcast(tensor, group=group, group_src=stage)
        yield name, tensor


def _stage_specs(model: MegatronModel) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(HF name, shape, dtype) of what ``_stage_tensors`` yields, worked out on meta tensors."""
    params = dict(model.module.named_parameters())
    specs = []
    for mapping in _exported_mappings(model):
        param = params[mapping.megatron_name]
        shape = list(param.shape)
        dim = Partition.of(param).dim
        if dim is not None:
            shape[dim] *= model.parallel.tp_size
        full = torch.empty(shape, dtype=param.dtype, device="meta")
        specs += [(name, t.shape, t.dtype) for name, t in zip(mapping.hf_names, to_hf(model.arch, mapping, full))]
    return specs


def _exported_mappings(model: MegatronModel):
    """This stage's mappings minus copies another stage exports (the tied output layer)."""
    return [m for m in weight_mappings(model.arch, model.parallel.pp_rank, model.parallel.pp_size) if m.exported]
