"""The Megatron optimizer and one optimizer step over a list of micro-batches.

Gradient scale, independent of TP/DP layout and of how the batch is cut into micro-batches::

    grad = d/dθ [ sum over DP ranks r, micro-batches b of loss_sum(r, b) ] / num_global_tokens

Each micro-batch's loss is ``loss_sum / num_global_tokens``. The model config sets
``calculate_per_token_loss=True``, under which Megatron DDP *sums* (not averages) gradients over DP
ranks and the schedule does not divide by the number of micro-batches; ``_sync_grads`` then skips the
schedule's own division by its token count, because the caller's ``num_global_tokens`` already did it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from rlrun.megatron.logprobs import forward_logits, model_token_stats
from rlrun.megatron.model import MegatronModel
from rlrun.megatron.moe import aux_loss_metrics
from rlrun.megatron.multi_tensor import patch_multi_tensor
from rlrun.megatron.pipeline import from_last_stage, run_schedule
from rlrun.runtime.dist import all_reduce

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

RESERVED_METRICS = ("loss", "grad_norm")


class MicroBatch(Protocol):
    """What ``train_step`` reads of a micro-batch; ``loss_fn`` reads the rest (masks, advantages...).

    The tensors may live on the CPU (they are moved to the model's device); ``loss_fn`` gets log-probs
    on the model's device and must move what it reads from the micro-batch there itself. A ``loss_mask``
    ``[B, S-1]`` (``rlrun.data.batch.MicroBatch``'s), where the micro-batch has one, says which positions the
    loss reads: a chunked LM head (``model.lm_head``, the default) scores only those, the others read 0."""

    tokens: torch.Tensor
    """[B, S] token ids, right-padded."""
    position_ids: torch.Tensor
    """[B, S], 0..S-1 in every row."""


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro_batch, logprobs [B, S-1][, entropy [B, S-1] when ``with_entropy``]) -> (loss summed over
loss-masked tokens, {metric: summed tensor}). Outside the micro-batch's ``loss_mask`` both may read 0.

Every call on every rank must return the same metric names (they are summed by one all-reduce), and
none of ``RESERVED_METRICS``."""


def make_optimizer(
    model: MegatronModel,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    clip_grad: float,
    cpu_offload: bool = False,
    offload_fraction: float = 1.0,
) -> MegatronOptimizer:
    """Megatron's Adam(W) over the DDP model: fp32 main weights for bf16 models, global-norm clipping;
    the distributed optimizer when the model's DDP was built for it (``build_model``'s flag), its state in host
    memory with ``cpu_offload`` (:func:`optimizer_config`).

    Megatron keeps per-group ``lr_mult``/``wd_mult`` for its LR scheduler to apply; they are applied here
    once, so the optimizer is right without a scheduler too (:func:`make_scheduler` takes over from there).
    """
    from megatron.core.optimizer import get_megatron_optimizer

    patch_multi_tensor()  # the gradient norm without a host wait per tensor (rlrun/megatron/multi_tensor.py)
    config = optimizer_config(
        model.dtype,
        model.ddp.ddp_config.use_distributed_optimizer,
        model.parallel.device.type,
        lr=lr,
        min_lr=lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=clip_grad,
        cpu_offload=cpu_offload,
        offload_fraction=offload_fraction,
    )
    optimizer = get_megatron_optimizer(config, [model.ddp])
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_mult"]
        group["weight_decay"] = weight_decay * group["wd_mult"]
    fuse_adam(optimizer)
    return optimizer


def fuse_adam(optimizer: MegatronOptimizer) -> None:
    """Step torch's Adam(W) inside Megatron's optimizer with torch's fused kernel.

    Without TransformerEngine or Apex Megatron builds ``torch.optim.AdamW`` with its default, the multi-tensor
    ``foreach`` path: several passes over the moments, and a temporary the size of all the parameters (the
    square root of the second moments, 4 bytes per parameter). The offloader runs every optimizer step inside the
    trainer's region (Adam creates its moments there at the first step), so those temporaries' blocks would stay in the
    region's pool and be copied to the host and back at every sleep and wake with the state, a quarter more bytes each
    way (BENCHMARKS.md, "Offload: trainer and engine taking turns on one GPU"). The fused kernel updates in place, one
    launch per tensor chunk. torch reads ``foreach``/``fused`` from the param groups at every step and checks each
    parameter's device and dtype at the first. The host Adam of ``optimizer.cpu_offload`` (Megatron's own class) is left
    as it is."""
    for part in optimizer_parts(optimizer):
        adam = getattr(part, "optimizer", None)
        if type(adam) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in adam.param_groups:
            group.update(foreach=False, fused=True)
        adam.defaults.update(foreach=False, fused=True)


def optimizer_parts(optimizer: MegatronOptimizer) -> list:
    """The Megatron optimizers inside ``optimizer``: a ChainedOptimizer's parts, else ``optimizer`` itself."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def adam_step(count: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """An Adam step count as torch keeps it for ``param`` of ``group``: on the parameter's device for the fused
    kernel (:func:`fuse_adam`), which reads it there, on the host otherwise."""
    return torch.tensor(float(count), device=param.device if group.get("fused") else "cpu")


def optimizer_config(
    dtype: str,
    distributed: bool,
    device_type: str,
    cpu_offload: bool = False,
    offload_fraction: float = 1.0,
    **adam: float,
):
    """Megatron's ``OptimizerConfig`` for Adam on a ``dtype`` model (``adam``: its lr / betas / eps / clip keys).

    ``cpu_offload`` (``optimizer.cpu_offload``): Megatron's ``HybridDeviceOptimizer`` steps the distributed
    optimizer's fp32 shards with torch's AdamW on the host, the first ``offload_fraction`` of them by count, with
    the gradient copies to the host and the weight copies back on side streams, per parameter
    (``overlap_cpu_optimizer_d2h_h2d``). Megatron's "precision-aware" variant, which would also keep the fp32
    main weights on the host, needs TransformerEngine (its config check calls TE's version), so here the device
    keeps bf16 weights, fp32 gradients and fp32 main weights (10 bytes per parameter) and the host Adam's
    moments and its own copy of the main weights (12 bytes per parameter, pinned)."""
    from megatron.core.optimizer import OptimizerConfig

    if cpu_offload:
        why = _offload_refusal(dtype, distributed, device_type)
        if why:
            raise ValueError(f"optimizer.cpu_offload (true) must {why}")
    bf16 = dtype == "bfloat16"
    offload = (
        dict(
            optimizer_cpu_offload=True, optimizer_offload_fraction=offload_fraction, overlap_cpu_optimizer_d2h_h2d=True
        )
        if cpu_offload
        else {}
    )
    return OptimizerConfig(
        optimizer="adam",
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distributed,
        **adam,
        **offload,
    )


def _offload_refusal(dtype: str, distributed: bool, device_type: str) -> str | None:
    """Why optimizer state offload cannot work here (the rest of an error message), or None."""
    if device_type != "cuda":
        return (
            "run on CUDA because on the CPU the optimizer state is in host memory already (and Megatron's "
            "HybridDeviceOptimizer copies on CUDA streams); set optimizer.cpu_offload: false"
        )
    if not distributed:
        return (
            "go with optimizer.use_distributed_optimizer because Megatron offloads the distributed optimizer's "
            "shards only; set optimizer.use_distributed_optimizer: true"
        )
    if dtype != "bfloat16":
        return (
            f"go with model.dtype bfloat16 (not {dtype}) because the offloaded state is the fp32 main copy of "
            "bf16 weights; set model.dtype: bfloat16"
        )
    return None


def make_scheduler(optimizer: MegatronOptimizer, cfg: OptimizerSettings, num_steps: int) -> OptimizerParamScheduler:
    """Megatron's OptimizerParamScheduler for ``cfg`` (rlrun.config.schema.OptimizerConfig): linear warmup
    from 0 over ``lr_warmup_steps``, then constant / linear / cosine to ``min_lr`` at ``lr_decay_steps``
    (default ``num_steps``); weight decay constant. Call ``step(1)`` after every optimizer step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = cfg.lr_decay_steps if cfg.lr_decay_steps is not None else num_steps
    if cfg.lr_decay_style != "constant" and decay_steps <= cfg.lr_warmup_steps:
        raise ValueError(
            f"optimizer.lr_decay_steps ({decay_steps}) must exceed optimizer.lr_warmup_steps "
            f"({cfg.lr_warmup_steps}) because decay starts after warmup; set lr_decay_steps "
            f"(default train.num_steps) larger or warm up for fewer steps"
        )
    for group in optimizer.param_groups:  # Megatron reads each group's bounds first; make_optimizer set both to lr
        group["max_lr"], group["min_lr"] = cfg.lr, cfg.min_lr
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def make_optimizer_and_scheduler(
    model: MegatronModel, cfg: OptimizerSettings, num_steps: int
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """:func:`make_optimizer` and :func:`make_scheduler` from one optimizer config (the actor's or the
    critic's)."""
    optimizer = make_optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        cpu_offload=cfg.cpu_offload,
        offload_fraction=cfg.offload_fraction,
    )
    return optimizer, make_scheduler(optimizer, cfg, num_steps)


class OptimizerSettings(Protocol):
    """What :func:`make_optimizer_and_scheduler` reads of ``rlrun.config.schema.OptimizerConfig``."""

    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    cpu_offload: bool
    offload_fraction: float
    lr_warmup_steps: int
    lr_decay_style: Literal["constant", "linear", "cosine"]
    lr_decay_steps: int | None


def _sync_grads(model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
    """Megatron's ``finalize_model_grads`` (DP all-reduce of the grad buffers) without token division."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model_chunks, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def train_step(
    model: MegatronModel,
    optimizer: MegatronOptimizer,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    num_global_tokens: int,
    temperature: float,
    with_entropy: bool = False,
) -> dict[str, float]:
    """Forward/backward every micro-batch, sync gradients over DP, clip and step.

    Returns ``loss`` (sum of ``loss_sum`` over all DP ranks and micro-batches / ``num_global_tokens``),
    ``grad_norm`` (before clipping) and every metric of ``loss_fn`` summed over micro-batches and DP ranks,
    the same on every rank. Micro-batches may differ in shape, also with PP > 1 (``rlrun.megatron.pipeline``).
    """

    def output_loss(micro_batch, output):
        logprobs, entropy = model_token_stats(
            model,
            output,
            micro_batch.tokens,
            temperature,
            with_entropy,
            kept_ids=getattr(micro_batch, "kept_ids", None),  # top-p mask replay; None without it
            scored=getattr(micro_batch, "loss_mask", None),  # the head scores the loss's positions only
        )
        return loss_fn(micro_batch, logprobs, *((entropy,) if with_entropy else ()))

    return optimizer_step(model, optimizer, micro_batches, output_loss, num_global_tokens)


def optimizer_step(
    model: MegatronModel,
    optimizer: MegatronOptimizer,
    micro_batches: Sequence,
    output_loss: Callable,
    num_global_tokens: int,
) -> dict[str, float]:
    """The schedule shared by the actor and the critic: ``output_loss(micro_batch, model_output)`` gives
    ``(loss_sum, metrics)``; gradients are d(sum over DP ranks and micro-batches of loss_sum) /
    ``num_global_tokens`` (DDP sums, never averages, over DP).

    With PP > 1 Megatron's 1F1B schedule runs ``output_loss`` on the last stage only; its sums are then
    broadcast to the other stages. The grad norm and the step already span the pipeline in Megatron."""
    if num_global_tokens <= 0:
        raise ValueError(
            f"num_global_tokens ({num_global_tokens}) must be positive because it divides the "
            f"loss; count the loss-masked tokens of the whole step across DP ranks"
        )
    config = model.module.config
    config.no_sync_func = model.ddp.no_sync
    config.finalize_model_grads_func = _sync_grads
    # 1/N through grad_scale_func, not in loss_func: Megatron scales MoE aux-loss gradients by the same
    # function (its per-token aux loss is multiplied by the micro-batch's tokens, expecting this division).
    config.grad_scale_func = lambda loss: loss / num_global_tokens
    model.ddp.zero_grad_buffer()
    optimizer.zero_grad()

    def forward_step(data_iterator, _ddp_model):
        micro_batch = next(data_iterator)
        output = forward_logits(model, micro_batch.tokens, micro_batch.position_ids)

        def loss_func(out):
            loss_sum, metrics = output_loss(micro_batch, out)
            reserved = set(RESERVED_METRICS) & set(metrics)
            if reserved:
                raise ValueError(f"loss_fn metric names {sorted(reserved)} are reserved by train_step; rename them")
            no_token_count = torch.zeros([], dtype=torch.int, device=out.device)
            return loss_sum, no_token_count, {**metrics, "loss": (loss_sum / num_global_tokens).detach()}

        return output, loss_func

    per_micro_batch = run_schedule(model, forward_step, micro_batches, forward_only=False)
    router_losses = aux_loss_metrics(model.arch.moe, len(micro_batches)) if model.arch.moe is not None else {}
    sums = from_last_stage(model, _sum_over_dp(per_micro_batch) if model.parallel.is_last_stage else None)
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise RuntimeError("the Megatron optimizer skipped the update (non-finite gradients)")
    return {**sums, **router_losses, "grad_norm": float(grad_norm)}


def _sum_over_dp(per_micro_batch: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum each metric over this rank's micro-batches, then over DP ranks (TP ranks hold copies; last
    pipeline stage only: the other stages have no metrics)."""
    from megatron.core import parallel_state as mpu

    names = sorted(per_micro_batch[0])
    if any(sorted(metrics) != names for metrics in per_micro_batch):
        raise ValueError(
            f"loss_fn must return the same metric names for every micro-batch; got "
            f"{[sorted(m) for m in per_micro_batch]}"
        )
    totals = torch.stack([sum(m[name].detach().float().reshape(()) for m in per_micro_batch) for name in names])
    all_reduce(totals, mpu.get_data_parallel_group())
    return dict(zip(names, totals.tolist(), strict=False))
