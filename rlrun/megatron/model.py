"""Build this rank's shard of a Megatron ``GPTModel`` from an HF directory, wrapped in Megatron DDP.

The model uses Megatron's local layer spec (plain PyTorch modules, no TransformerEngine), so the same
code runs on CPU with gloo and on GPU. Weights are loaded before the DDP wrap and before any optimizer
exists: the bf16 optimizer copies its fp32 master weights from the parameters when it is built.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlrun.megatron.hf_config import ModelArch, head_padding_note, transformer_config
from rlrun.megatron.hf_weights import HFCheckpoint, to_megatron, weight_mappings
from rlrun.megatron.lora import is_lora_param
from rlrun.megatron.mla import patch_mla_without_te
from rlrun.megatron.moe import (
    MoEOptions,
    is_expert_param,
    patch_router_without_te,
    reduce_expert_grads_over_expert_dp,
)
from rlrun.megatron.recompute import Recompute
from rlrun.megatron.rope_apply import patch_rope
from rlrun.megatron.swiglu_apply import patch_swiglu
from rlrun.megatron.tp_layout import Partition
from rlrun.runtime.dist import Parallel

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from rlrun.config.schema import LoraConfig
    from rlrun.megatron.lora import LoraAdapters

log = logging.getLogger(__name__)


@dataclass
class MegatronModel:
    """This rank's model: the DDP wrapper (call it for forward/backward), its architecture and layout.

    ``ddp.module`` is the bare ``GPTModel`` whose ``named_parameters`` are the Megatron names of
    ``hf_weights.weight_mappings`` (plus the LoRA branches' ``*.lora.*``, which no HF tensor maps).
    """

    ddp: DistributedDataParallel
    arch: ModelArch
    parallel: Parallel
    dtype: str
    lora: LoraAdapters | None = None
    """The LoRA adapters (``model.lora``; rlrun/megatron/lora.py); None: every parameter trains."""
    deferred_head: bool = False
    """True when the last stage's forward returns hidden states, not logits (rlrun/megatron/lm_head.py)."""
    keeps_head_logits: bool = False
    """``model.lm_head: chunked_kept``: the deferred head keeps its chunks' logits for the backward."""

    @property
    def module(self) -> GPTModel:
        return self.ddp.module


def build_model(
    hf_dir: str,
    parallel: Parallel,
    dtype: str = "float32",
    distributed_optimizer: bool = False,
    moe_options: MoEOptions | None = None,
    packed_attention: str = "auto",
    lora: LoraConfig | None = None,
    seed: int = 0,
    recompute: Recompute | None = None,
    lm_head: str = "chunked",
    grad_buffer_region: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> MegatronModel:
    """The GPTModel of ``hf_dir`` (dropout off), loaded with this rank's TP shards of its pipeline stage's
    layers (and, for MoE models, its EP rank's experts in ETP shards), in Megatron DDP.

    ``moe_options``: routing and load-balancing options of MoE models (ignored for dense ones);
    ``packed_attention``: ``model.packed_attention`` (rlrun/megatron/attention.py); ``recompute``:
    ``train.recompute`` (rlrun/megatron/recompute.py); ``lm_head``: ``model.lm_head`` (``chunked``, ``chunked_kept``:
    the model returns hidden states and the log-prob code projects them chunk by chunk, rlrun/megatron/lm_head.py);
    ``lora``: freeze the base and add LoRA branches initialised from ``seed`` (rlrun/megatron/lora.py) before
    the DDP wrap, so only they get gradient buffers and optimizer state; ``grad_buffer_region``: where the gradient
    buffers are allocated (:func:`wrap_ddp`)."""
    gpt, arch, config = build_gpt(hf_dir, parallel, dtype, moe_options, packed_attention, recompute)
    deferred = lm_head in ("chunked", "chunked_kept") and parallel.is_last_stage
    if deferred:
        from rlrun.megatron.lm_head import defer_output_layer

        defer_output_layer(gpt)
    if parallel.is_rank0 and (padding_note := head_padding_note(arch, parallel.tp_size)):
        # A warning, not info: it costs compute the user may avoid, and the trainer sets up no logging
        # handlers, so only warnings reach the console.
        log.warning("%s: %s", hf_dir, padding_note)
    adapters = None
    if lora is not None:
        from rlrun.megatron.lora import attach_lora

        adapters = attach_lora(gpt, arch, lora, parallel, seed)
    model = wrap_ddp(gpt, arch, config, parallel, dtype, distributed_optimizer, grad_buffer_region)
    model.lora = adapters
    model.deferred_head = deferred
    model.keeps_head_logits = deferred and lm_head == "chunked_kept"
    return model


def build_gpt(
    hf_dir: str,
    parallel: Parallel,
    dtype: str,
    moe_options: MoEOptions | None = None,
    packed_attention: str = "auto",
    recompute: Recompute | None = None,
) -> tuple[GPTModel, ModelArch, TransformerConfig]:
    """The bare GPTModel of ``hf_dir`` for this rank (its pipeline stage, TP/EP shards), HF weights loaded;
    shared by the actor (:func:`build_model`) and the critic (rlrun/megatron/value_head.py)."""
    from megatron.core.models.gpt import GPTModel

    from rlrun.megatron.attention import layer_spec

    arch = ModelArch.from_hf_dir(hf_dir)
    if parallel.cp_size > 1 and (arch.moe is not None or arch.mla is not None):
        raise ValueError(
            f"parallel.cp ({parallel.cp_size}) must be 1 for {hf_dir} because context parallelism is implemented for "
            "dense models with standard attention only (not MoE routing or multi-latent attention); set parallel.cp: 1"
        )
    patch_rope()  # Megatron's RoPE without its per-layer repeats (rlrun/megatron/rope_apply.py)
    patch_swiglu()  # the gated MLP's SiLU * up by the Triton kernel on CUDA (rlrun/megatron/swiglu_apply.py)
    if arch.moe is not None:
        patch_router_without_te()
    if arch.mla is not None:
        patch_mla_without_te()
    config = transformer_config(
        arch,
        parallel.tp_size,
        parallel.pp_size,
        dtype,
        parallel.ep_size,
        parallel.etp_size,
        moe_options,
        recompute,
        parallel.cp_size,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, parallel.pp_rank, parallel.pp_size, packed_attention, dtype),
        vocab_size=arch.padded_vocab_size(parallel.tp_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel.is_first_stage,
        post_process=parallel.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rope.rotary_percent if arch.rope is not None else 1.0,
    )
    if arch.rope is not None:
        arch.rope.apply_to(gpt.rotary_pos_emb)  # transformers' frequencies, from the host (rlrun/megatron/rope.py)
    # The local spec's torch RMSNorm ignores params_dtype; cast the whole model like Megatron's
    # Float16Module does (RoPE's inv_freq is a plain attribute and stays fp32).
    gpt = gpt.to(device=parallel.device, dtype=config.params_dtype)
    if arch.moe is not None:
        reduce_expert_grads_over_expert_dp(gpt, parallel.ep_size, parallel.etp_size, parallel.tp_size)
    load_hf_weights(gpt, arch, HFCheckpoint(hf_dir), parallel)
    return gpt, arch, config


def wrap_ddp(
    gpt: GPTModel,
    arch: ModelArch,
    config: TransformerConfig,
    parallel: Parallel,
    dtype: str,
    distributed_optimizer: bool = False,
    grad_buffer_region: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> MegatronModel:
    """``gpt`` in Megatron DDP (fp32 grad buffers); ``distributed_optimizer``: make_optimizer builds
    Megatron's distributed optimizer over these buffers.

    ``grad_buffer_region``: a context for DDP's constructor, which allocates the gradient buffers, where their
    contents need not outlive a trainer sleep (``Offloader.scratch_region``: every step zeroes them before its
    first backward, so a sleep need not copy them out and back: 4 bytes a parameter). Not for the distributed
    optimizer, whose constructor call also allocates the bf16 parameter buffer that holds the weights."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from rlrun.megatron.wgrad_fusion import fuse_weight_gradient_accumulation

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    with contextlib.nullcontext() if distributed_optimizer else grad_buffer_region():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    fuse_weight_gradient_accumulation(gpt)  # on CUDA: weight-gradient GEMMs add into main_grad themselves
    return MegatronModel(ddp=ddp, arch=arch, parallel=parallel, dtype=dtype)


@torch.no_grad()
def load_hf_weights(gpt: GPTModel, arch: ModelArch, checkpoint: HFCheckpoint, parallel: Parallel) -> None:
    """Copy every HF tensor of this rank's pipeline stage (and EP rank's experts) into its shard of the
    matching Megatron parameter; routed experts are sharded over the expert-TP ranks, the rest over TP."""
    params = dict(gpt.named_parameters())
    mappings = weight_mappings(arch, parallel.pp_rank, parallel.pp_size, parallel.ep_rank, parallel.ep_size)
    unmapped = {name for name in params if not is_lora_param(name)} - {m.megatron_name for m in mappings}
    if unmapped:
        raise RuntimeError(
            f"Megatron parameters without an HF source: {sorted(unmapped)}; rlrun/megatron/hf_weights.py must map them"
        )
    # Buffers the map names too: GLM-4.5's router correction bias (rlrun.megatron.moe).
    tensors = {**dict(gpt.named_buffers()), **params}
    for mapping in mappings:
        param = tensors[mapping.megatron_name]
        hf_tensors = [checkpoint.get(name) for name in mapping.hf_names]
        full = to_megatron(arch, mapping, hf_tensors, parallel.tp_size)
        if is_expert_param(mapping.megatron_name):
            shard = Partition.of(param).shard(full, parallel.etp_rank, parallel.etp_size)
        else:
            shard = Partition.of(param).shard(full, parallel.tp_rank, parallel.tp_size)
        if shard.shape != param.shape:
            raise RuntimeError(
                f"{checkpoint.hf_dir}: {mapping.hf_names} give {mapping.megatron_name} a shard of "
                f"shape {tuple(shard.shape)} but the model expects {tuple(param.shape)}; config.json "
                f"does not describe these weights"
            )
        param.copy_(shard)
