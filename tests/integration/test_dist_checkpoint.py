"""Megatron distributed checkpoints across data-parallel sizes, with the distributed optimizer and an LR schedule.

Reference: 2 ranks (DP=2) train step 1, checkpoint, train step 2 on a global batch of two micro-batches
(one per rank). Candidate: 1 rank restores that checkpoint and trains step 2 on the same global batch
(both micro-batches): the loss, gradient norm, LR and updated weights must match the 2-rank
continuation (up to the order of the DP sum), which needs the model, the Adam state (re-sharded when
the distributed optimizer split it over 2 ranks) and the scheduler's step all restored.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.slow
OPTIM = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, clip_grad=1.0)


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor


@dataclasses.dataclass
class State:
    step: int
    weight_version: int


def loss_fn(mb: Batch, logprobs: torch.Tensor):
    return -(logprobs * mb.loss_mask).sum(), {"tokens": mb.loss_mask.sum()}


def global_batches(vocab_size: int) -> list[list[Batch]]:
    """Two steps, each a global batch of two micro-batches."""
    gen = torch.Generator().manual_seed(5)
    steps = []
    for _ in range(2):
        step = []
        for _ in range(2):
            tokens = torch.randint(0, vocab_size, (2, 10), generator=gen)
            step.append(Batch(tokens, torch.arange(10).expand(2, 10), (torch.rand(2, 9, generator=gen) < 0.8).float()))
        steps.append(step)
    return steps


def _build(hf_dir: str, parallel, distributed_optimizer: bool):
    from rlrun.config.schema import OptimizerConfig
    from rlrun.megatron import build_model, make_optimizer, make_scheduler

    model = build_model(hf_dir, parallel, distributed_optimizer=distributed_optimizer)
    optimizer = make_optimizer(model, **OPTIM)
    schedule = OptimizerConfig(
        lr=OPTIM["lr"], weight_decay=OPTIM["weight_decay"], lr_warmup_steps=1, lr_decay_style="cosine", min_lr=1e-3
    )
    return model, optimizer, make_scheduler(optimizer, schedule, num_steps=4)


def _step(model, optimizer, scheduler, micro_batches: list[Batch], num_tokens: int) -> dict:
    from rlrun.megatron import train_step

    lr = scheduler.get_lr(optimizer.param_groups[0])
    out = train_step(model, optimizer, micro_batches, loss_fn, num_tokens, 1.0)
    scheduler.step(1)
    return {**out, "lr": lr, "group_lr": optimizer.param_groups[0]["lr"]}


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items() if v is not None}


def _two_ranks(hf_dir: str, run_dir: str, distributed_optimizer: bool) -> dict:
    from rlrun.config.schema import CheckpointConfig
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.checkpoint import Checkpointer

    parallel = init_distributed(tp=1, pp=1, seed=0)
    model, optimizer, scheduler = _build(hf_dir, parallel, distributed_optimizer)
    steps = global_batches(model.arch.vocab_size)
    tokens = [int(sum(b.loss_mask.sum() for b in step)) for step in steps]
    first = _step(model, optimizer, scheduler, [steps[0][parallel.dp_rank]], tokens[0])
    Checkpointer(CheckpointConfig(), run_dir, parallel).save(
        State(1, 1), model, optimizer, None, blocking=True, scheduler=scheduler
    )
    second = _step(model, optimizer, scheduler, [steps[1][parallel.dp_rank]], tokens[1])
    weights = _weights(model)
    destroy_distributed()
    return {"first": first, "second": second, "weights": weights}


def _one_rank(hf_dir: str, run_dir: str, distributed_optimizer: bool) -> dict:
    from rlrun.config.schema import CheckpointConfig
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.checkpoint import Checkpointer

    parallel = init_distributed(tp=1, pp=1, seed=0)
    model, optimizer, scheduler = _build(hf_dir, parallel, distributed_optimizer)
    run_state = Checkpointer(CheckpointConfig(), run_dir, parallel).restore(model, optimizer, None, scheduler=scheduler)
    steps = global_batches(model.arch.vocab_size)
    tokens = int(sum(b.loss_mask.sum() for b in steps[1]))
    second = _step(model, optimizer, scheduler, steps[1], tokens)
    weights = _weights(model)
    destroy_distributed()
    return {"run_state": run_state, "second": second, "weights": weights}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_checkpoint_from_two_dp_ranks_resumes_on_one(tiny_model_dirs, tmp_path, distributed_optimizer):
    hf_dir = str(tiny_model_dirs["qwen3"])
    reference = run_distributed(_two_ranks, 2, hf_dir, str(tmp_path), distributed_optimizer)
    resumed = run_distributed(_one_rank, 1, hf_dir, str(tmp_path), distributed_optimizer)
    assert resumed["run_state"] == {"step": 1, "weight_version": 1}
    # Megatron's schedule: warmup step 0 has LR 0; step 1 is the cosine's start (peak); the next is cosine.
    assert reference["first"]["lr"] == 0.0 and reference["second"]["lr"] == pytest.approx(1e-2)
    assert resumed["second"]["lr"] == reference["second"]["lr"]
    assert resumed["second"]["group_lr"] == reference["second"]["group_lr"]
    for key in ("loss", "grad_norm"):
        assert resumed["second"][key] == pytest.approx(reference["second"][key], rel=1e-6, abs=0), key
    # A restore that lost the Adam state or the scheduler's step (LR 0 again) would move the weights differently.
    assert reference["weights"].keys() == resumed["weights"].keys()
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
