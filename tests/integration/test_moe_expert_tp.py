"""One Megatron train step on the tiny Qwen3-MoE: expert tensor parallelism without expert parallelism
(``parallel.etp: 2`` at ``ep: 1``, ``tp: 1``, two ranks) gives one rank's gradients.

Here the two ranks are data-parallel for the dense part and split every expert's weights between them. A
gradient the data-parallel reduction sums over the two expert-TP ranks adds two different slices of each
expert (megatron-core 0.16.1 leaves experts on the dense reduction at EP=1;
``rlrun.megatron.moe.reduce_expert_grads_over_expert_dp``), and the gradient norm then counts each rank's
slice as the whole expert: both show here, in the experts' gathered gradients and in the norm.

Each micro-batch is one row on both sides, so the load-balancing loss (on, with a coefficient large
enough to move the norm) sees the same tokens per micro-batch at one rank and at two. Clipping is off:
the fp32 optimizer's step leaves every ``main_grad`` as the reduction wrote it.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_train import OPTIM, TEMPERATURE, make_batch, pg_loss

from dist_utils import run_distributed

pytestmark = pytest.mark.slow

AUX_COEFF = 0.5
"""The load-balancing term's share of the router gradient is then far above fp32 round-off."""
REL = 1e-6
GRAD_ATOL = 2e-6
"""Of each gradient tensor's largest entry. fp32: the two layouts sum the experts' outputs and the gradients
over ranks and micro-batches in another order; measured (torch 2.13 CPU, megatron-core 0.16.1) 1.0e-7 on the
norm and at most 6.1e-7 of a tensor's largest entry (an input_layernorm weight). Summing the expert-TP slices
moved every expert's gradient by its own largest entry and the norm by 3.5e-5."""


def _grads_worker(hf_dir: str, etp: int, batch) -> dict:
    from megatron.core import parallel_state as mpu

    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.megatron.moe import MoEOptions, is_expert_param
    from rlrun.megatron.tp_layout import Partition
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0, etp=etp)
    rows = batch.tokens.shape[0] // parallel.dp_size
    local = batch.rows(parallel.dp_rank * rows, (parallel.dp_rank + 1) * rows, parallel.device)
    model = build_model(hf_dir, parallel, moe_options=MoEOptions(aux_loss_coeff=AUX_COEFF))
    optimizer = make_optimizer(model, **{**OPTIM, "clip_grad": 0.0})
    micro_batches = [local.rows(i, i + 1) for i in range(rows)]
    stats = train_step(model, optimizer, micro_batches, pg_loss, int(batch.loss_mask.sum()), TEMPERATURE)
    grads = {}
    for name, param in model.module.named_parameters():
        grad = param.main_grad.detach()
        if is_expert_param(name):
            grad = Partition.of(param).gather(grad, etp, mpu.get_expert_tensor_parallel_group())
        grads[name] = grad.cpu().clone()
    destroy_distributed()
    return {"stats": stats, "grads": grads}


def test_expert_tp2_gradients_equal_one_rank(tiny_moe_dir):
    batch = make_batch(vocab_size=264, rows=4, seq=12)
    (one,) = run_distributed(_grads_worker, 1, str(tiny_moe_dir), 1, batch, all_ranks=True)
    etp2 = run_distributed(_grads_worker, 2, str(tiny_moe_dir), 2, batch, all_ranks=True)
    assert one["stats"]["moe_load_balancing_loss"] > 0
    assert any(".local_experts." in name for name in one["grads"])
    for result in etp2:
        for name in ("loss", "moe_load_balancing_loss", "grad_norm"):
            assert result["stats"][name] == pytest.approx(one["stats"][name], rel=REL), name
        assert result["grads"].keys() == one["grads"].keys()
        for name, want in one["grads"].items():
            got = result["grads"][name]
            torch.testing.assert_close(got, want, rtol=0, atol=GRAD_ATOL * float(want.abs().max()), msg=name)


def _save_worker(hf_dir: str, run_dir: str, batch) -> None:
    """Train one step at expert-TP 1 and checkpoint it."""
    from rlrun.config.schema import CheckpointConfig
    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.checkpoint import Checkpointer, RunState

    parallel = init_distributed(tp=1, pp=1, seed=0, etp=1)
    model = build_model(hf_dir, parallel)
    optimizer = make_optimizer(model, **OPTIM)
    local = batch.rows(parallel.dp_rank * 2, parallel.dp_rank * 2 + 2, parallel.device)
    train_step(model, optimizer, [local], pg_loss, int(batch.loss_mask.sum()), TEMPERATURE)
    Checkpointer(CheckpointConfig(), run_dir, parallel).save(RunState(step=1), model, optimizer, None, blocking=True)
    destroy_distributed()


def _restore_worker(hf_dir: str, run_dir: str, etp: int) -> str | None:
    """Restore the checkpoint into a model and optimizer built at expert-TP ``etp``; the restore's error, or None."""
    from rlrun.config.schema import CheckpointConfig
    from rlrun.megatron import build_model, make_optimizer
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.checkpoint import Checkpointer

    parallel = init_distributed(tp=1, pp=1, seed=0, etp=etp)
    model = build_model(hf_dir, parallel)
    optimizer = make_optimizer(model, **OPTIM)
    try:
        Checkpointer(CheckpointConfig(), run_dir, parallel).restore(model, optimizer, None)
    except ValueError as err:
        return str(err)
    finally:
        destroy_distributed()
    return None


def test_a_checkpoint_of_another_expert_layout_is_refused_before_the_reader_runs(tiny_moe_dir, tmp_path):
    """Expert-TP 2 at EP 1 keeps the experts' optimizer apart (chained to the dense one), so a checkpoint saved
    at expert-TP 1 lacks the keys it reads: the restore names a missing key and how to keep the weights,
    instead of failing inside torch's distributed reader (whose exception is a BaseException). At expert-TP 1
    the same checkpoint restores."""
    batch = make_batch(vocab_size=264, rows=4, seq=12)
    run_distributed(_save_worker, 2, str(tiny_moe_dir), str(tmp_path), batch)
    assert run_distributed(_restore_worker, 2, str(tiny_moe_dir), str(tmp_path), 1, all_ranks=True) == [None, None]
    for error in run_distributed(_restore_worker, 2, str(tiny_moe_dir), str(tmp_path), 2, all_ranks=True):
        assert "must hold the optimizer state this run's optimizer reads" in error, error
        assert "chained_0.optimizer.state." in error and "rlrun convert mcore-to-hf --ckpt" in error, error
