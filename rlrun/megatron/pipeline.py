"""Pipeline parallelism (``parallel.pp > 1``): one way to run Megatron's schedule, and moving what the
last stage computed to the other stages of its pipeline.

Only the last stage holds the output layer, so logits, log-probs, values and loss metrics exist there
only. Every rank must still return the same thing (the loop runs in lockstep, and each rank keeps its
micro-batches' old/reference log-probs), so those results are broadcast over the pipeline group, from
the last stage to the ranks that hold the same TP shard of the other stages.

Micro-batches of different shapes share one schedule call: with ``variable_seq_lengths`` every p2p
exchange between stages sends its tensor's shape first, so nothing is padded to a common shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlrun.megatron.model import MegatronModel

ForwardStep = Callable[[Any, Any], tuple[torch.Tensor, Callable]]
"""Megatron's ``forward_step_func(data_iterator, model) -> (output, loss_func)``."""


def run_schedule(
    model: MegatronModel, forward_step: ForwardStep, micro_batches: Sequence, forward_only: bool
) -> list[dict[str, torch.Tensor]]:
    """Megatron's forward/backward schedule over ``micro_batches`` (1F1B when PP > 1, else no pipelining).

    Returns ``loss_func``'s metric dicts, one per micro-batch, on the last stage; ``[]`` on other stages.
    The schedule calls ``forward_step`` once per micro-batch on every stage; ``loss_func`` runs on the
    last stage only.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.module.config.variable_seq_lengths = model.parallel.pp_size > 1
    first = micro_batches[0].tokens
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=model.ddp,
        num_microbatches=len(micro_batches),
        seq_length=first.shape[1],
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
    )


def last_stage_outputs(
    model: MegatronModel,
    tokens: torch.Tensor,
    forward: Callable[[], torch.Tensor],
    head: Callable[[torch.Tensor], list[torch.Tensor]],
    count: int,
) -> list[torch.Tensor]:
    """``head(forward())`` on every rank: ``count`` float32 tensors of shape ``[B, S-1]`` for ``tokens [B, S]``.

    PP=1: a plain (differentiable) forward. PP>1: the schedule's forward-only pass (``forward`` runs on
    every stage, ``head`` on the last one), then a broadcast from the last stage; no gradient flows.
    """
    if model.parallel.pp_size == 1:
        return head(forward())
    outputs: list[torch.Tensor] = []

    def forward_step(data_iterator, _ddp_model):
        next(data_iterator)
        output = forward()

        def collect(out: torch.Tensor):
            outputs.extend(t.float().contiguous() for t in head(out))  # gloo sends a view's storage
            return out.new_zeros(()), torch.zeros([], dtype=torch.int, device=out.device), {}

        return output, collect

    with torch.no_grad():
        run_schedule(model, forward_step, [_Shape(tokens)], forward_only=True)
    if not model.parallel.is_last_stage:
        rows, columns = tokens.shape[0], tokens.shape[1] - 1
        outputs = [torch.empty(rows, columns, dtype=torch.float32, device=model.parallel.device) for _ in range(count)]
    if len(outputs) != count:
        raise RuntimeError(f"head returned {len(outputs)} tensors but the caller announced {count}")
    group = _pipeline_group()
    for tensor in outputs:
        dist.broadcast(tensor, group=group, group_src=model.parallel.pp_size - 1)
    return outputs


def from_last_stage(model: MegatronModel, value: Any) -> Any:
    """The last stage's ``value`` (a picklable object) on every stage of this rank's pipeline."""
    if model.parallel.pp_size == 1:
        return value
    box = [value if model.parallel.is_last_stage else None]
    dist.broadcast_object_list(box, group=_pipeline_group(), group_src=model.parallel.pp_size - 1)
    return box[0]


class _Shape:
    """A stand-in micro-batch for ``run_schedule``: only ``tokens`` is read there (for its shape)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens


def _pipeline_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state as mpu

    return mpu.get_pipeline_model_parallel_group()
