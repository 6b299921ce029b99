"""Checkpointer on 2 real ranks (TP=2, so each rank saves a different shard), Megatron model and optimizer.

Reference: two train steps on one model. Candidate: one step, an *asynchronous* checkpoint, a second
step on the original while the checkpoint is written, then a fresh model + optimizer restored from
the checkpoint takes the second step: its weights must equal the reference exactly (Adam's moments and
step count come back, and the background write saw the weights of step 1, not step 2). Also: the
restored tensors equal the snapshot, ``keep_last`` prunes, and the directory layout is the documented one.
"""

from __future__ import annotations

import dataclasses
import json

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


def batches(vocab_size: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, vocab_size, (2, 10), generator=gen)
        out.append(Batch(tokens, torch.arange(10).expand(2, 10), (torch.rand(2, 9, generator=gen) < 0.8).float()))
    return out


def _worker(hf_dir: str, run_dir: str, dtype: str) -> dict:
    from rlrun.config.schema import CheckpointConfig
    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.checkpoint import Checkpointer

    parallel = init_distributed(tp=2, pp=1, seed=0)
    model = build_model(hf_dir, parallel, dtype=dtype)
    optimizer = make_optimizer(model, **OPTIM)
    steps = batches(model.arch.vocab_size)
    num_tokens = [int(b.loss_mask.sum()) for b in steps]
    train_step(model, optimizer, [steps[0]], loss_fn, num_tokens[0], 1.0)

    cfg = CheckpointConfig(save_interval=1, keep_last=1, async_save=True)
    saver = Checkpointer(cfg, run_dir, parallel)
    expected = {k: v.detach().clone() for k, v in model.module.state_dict().items() if v is not None}
    expected_rng = torch.get_rng_state()
    saver.save(State(step=1, weight_version=1), model, optimizer, None, blocking=False)
    train_step(model, optimizer, [steps[1]], loss_fn, num_tokens[1], 1.0)  # while the shard is written
    saver.wait()
    reference = {k: v.detach().clone() for k, v in model.module.state_dict().items() if v is not None}

    fresh = build_model(hf_dir, parallel, dtype=dtype)
    fresh_optimizer = make_optimizer(fresh, **OPTIM)
    loader = Checkpointer(cfg.model_copy(update={"resume": "auto"}), run_dir, parallel)
    run_state = loader.restore(fresh, fresh_optimizer, None)
    restored = {k: v.detach().clone() for k, v in fresh.module.state_dict().items() if v is not None}
    rng_after_restore = torch.get_rng_state()
    train_step(fresh, fresh_optimizer, [steps[1]], loss_fn, num_tokens[1], 1.0)
    resumed = {k: v.detach().clone() for k, v in fresh.module.state_dict().items() if v is not None}

    saver.save(State(step=2, weight_version=2), model, optimizer, None, blocking=True)
    destroy_distributed()
    return {
        "expected": expected,
        "restored": restored,
        "reference": reference,
        "resumed": resumed,
        "run_state": run_state,
        "rng_equal": torch.equal(expected_rng, rng_after_restore),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_checkpoint_restores_exactly_and_training_continues_identically(tiny_model_dirs, tmp_path, dtype):
    results = run_distributed(_worker, 2, str(tiny_model_dirs["qwen2"]), str(tmp_path), dtype, all_ranks=True)
    for rank, r in enumerate(results):
        assert r["run_state"] == {"step": 1, "weight_version": 1}
        assert r["rng_equal"]
        assert r["restored"].keys() == r["expected"].keys()
        for name in r["expected"]:
            assert torch.equal(r["restored"][name], r["expected"][name]), f"rank {rank} {name}: restored != saved"
            assert torch.equal(r["resumed"][name], r["reference"][name]), f"rank {rank} {name}: resumed step differs"
        moved = [n for n in r["expected"] if not torch.equal(r["expected"][n], r["reference"][n])]
        assert moved, "the second step changed nothing: the comparison would be vacuous"
    assert not torch.equal(
        results[0]["expected"]["decoder.layers.0.mlp.linear_fc1.weight"],
        results[1]["expected"]["decoder.layers.0.mlp.linear_fc1.weight"],
    )  # TP shards differ
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_000002"]  # keep_last=1 pruned step 1
    assert sorted(p.name for p in (ckpt_dir / "step_000002").iterdir()) == ["COMPLETE", "actor", "run_state.json"]
    assert {"metadata.json", ".metadata", "common.pt"} <= {p.name for p in (ckpt_dir / "step_000002/actor").iterdir()}
    marker = json.loads((ckpt_dir / "step_000002/COMPLETE").read_text())
    assert marker == {
        "step": 2,
        "layout": {"world_size": 2, "tp": 2, "pp": 1},
        "weights_only": False,
        "model_path": None,
    }
