"""Full HF-named tensors from a TP-sharded Megatron model, for weight sync and checkpoint export.

Every rank of a TP group must iterate the generator in lockstep: each parameter is one all-gather over
the TP group. DP replicas hold identical weights and need no communication.
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
    from megatron.core import parallel_state as mpu

    params = dict(model.module.named_parameters())
    tp_group = mpu.get_tensor_model_parallel_group()
    for mapping in weight_mappings(model.arch):
        param = params[mapping.megatron_name]
        partition = Partition.of(param)
        if partition.dim is None or model.parallel.tp_size == 1:
            full = param.detach().clone()
        else:
            shards = [torch.empty_like(param) for _ in range(model.parallel.tp_size)]
            dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
            full = partition.unshard(shards)
        yield from zip(mapping.hf_names, (t.contiguous() for t in to_hf(model.arch, mapping, full)))
