"""Several optimizer updates per rollout (``train.updates_per_rollout``, ``train.epochs_per_rollout``).

* On a real Megatron model (gloo, 2 DP ranks): the loop's ``train`` over 4 updates equals 4 hand-driven
  ``train_step`` calls on the same splits, each normalised by its own global token count (loss, grad
  norm and weights within 1e-6), with the old-policy log-probs computed once, before the first update.
* Through the CLI (one rank): the first update of every step has ``approx_kl == 0`` and ``clip_frac == 0`` exactly
  (the weights have not moved since the old-policy forward: slime's CI invariant), later ones do not,
  and the LR schedule counts updates.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from integration.test_algo_roles_megatron import TEMPERATURE
from integration.test_train_loop import run_train

pytestmark = pytest.mark.slow
NUM_UPDATES = 4


def make_update_batches(vocab_size: int, dp_rank: int):
    """Per update, one micro-batch of this rank's ragged rows with random group scores."""
    from rlrun.data.batch import MicroBatch

    gen = torch.Generator().manual_seed(11 + dp_rank)
    batches = []
    for u in range(NUM_UPDATES):
        rows, seq, prompt = 2 + u % 2, 10 + u, 3
        tokens = torch.randint(0, vocab_size, (rows, seq), generator=gen)
        mask = torch.zeros(rows, seq - 1)
        for i in range(rows):
            mask[i, prompt - 1 : seq - 1 - i] = 1.0
        batches.append(
            MicroBatch(
                tokens=tokens,
                position_ids=torch.arange(seq).expand(rows, seq),
                loss_mask=mask,
                advantages=torch.randn(rows, 1, generator=gen) * mask,
                rollout_logprobs=torch.zeros_like(mask),
            )
        )
    return batches


def _updates_worker(hf_dir: str, hand_driven: bool) -> dict:
    import rlrun.trainer.roles
    from minimal_config import run_config
    from rlrun.algo.aggregate import StepCounts
    from rlrun.algo.objective import Objective
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer_and_scheduler, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.actor import Actor, TrainerHooks, dp_sum
    from rlrun.trainer.batch import TrainBatch, Update
    from rlrun.trainer.roles import ModelRoles

    cfg = run_config(
        {
            "train": {"updates_per_rollout": NUM_UPDATES, "num_steps": 3},
            "optimizer": {"lr": 1e-2, "clip_grad": 0.0, "lr_decay_style": "linear", "min_lr": 0.0},
            "rollout": {"temperature": TEMPERATURE, "max_new_tokens": 12},
        }
    )
    parallel = init_distributed(tp=1, pp=1, seed=0)
    model = build_model(hf_dir, parallel)
    optimizer, scheduler = make_optimizer_and_scheduler(model, cfg.optimizer, 3 * NUM_UPDATES)
    roles = ModelRoles.create(cfg.algorithm, model, num_optimizer_steps=NUM_UPDATES)
    assert not roles.reuse_logprobs  # several updates: the old-policy forward is needed
    mbs = make_update_batches(model.arch.vocab_size, parallel.dp_rank)
    forwards = []
    fill = rlrun.trainer.roles.ModelRoles._fill
    rlrun.trainer.roles.ModelRoles._fill = lambda self, batches, *a: (
        forwards.append(len(batches)),
        fill(self, batches, *a),
    )
    actor = Actor(cfg, parallel, model, optimizer, scheduler, roles, None, TrainerHooks.load(cfg.algorithm))
    tokens = [int(dp_sum(parallel, mb.loss_mask.sum()).item()) for mb in mbs]
    samples = [int(dp_sum(parallel, torch.tensor(mb.num_loss_samples)).item()) for mb in mbs]
    batch = TrainBatch([Update([mb], n, k) for mb, n, k in zip(mbs, tokens, samples, strict=True)])
    actor.prepare(batch, step=0)
    stats = []
    if hand_driven:
        for mb, num_tokens, num_samples in zip(mbs, tokens, samples, strict=True):
            counts = StepCounts(num_tokens=num_tokens, num_samples=num_samples, max_response_len=12)
            lr = scheduler.get_lr(optimizer.param_groups[0])
            out = train_step(model, optimizer, [mb], Objective(cfg.algorithm, counts), num_tokens, TEMPERATURE, True)
            scheduler.step(1)
            stats.append({"loss": out["loss"], "grad_norm": out["grad_norm"], "lr": lr})
    else:
        metrics = actor.train(batch, step=0)
        for k in range(NUM_UPDATES):
            stats.append({name: metrics[f"train/update_{k}/{name}"] for name in ("loss", "grad_norm", "lr")})
        assert metrics["train/num_loss_tokens"] == sum(tokens)
    weights = {k: v.cpu() for k, v in export_hf_weights(model)}
    destroy_distributed()
    return {"stats": stats, "weights": weights, "forwards": forwards, "tokens": tokens}


def test_updates_equal_hand_driven_optimizer_steps_on_the_same_splits(tiny_model_dirs):
    hf_dir = str(tiny_model_dirs["llama"])
    loop = run_distributed(_updates_worker, 2, hf_dir, False, all_ranks=True)
    hand = run_distributed(_updates_worker, 2, hf_dir, True, all_ranks=True)
    for got, want in zip(loop, hand, strict=True):
        assert got["forwards"] == [NUM_UPDATES]  # one old-policy pass over the whole rollout's micro-batches
        assert len(set(got["tokens"])) > 1  # the updates differ in size: per-update normalisation matters
        for g, w in zip(got["stats"], want["stats"], strict=True):
            assert g == pytest.approx(w, rel=1e-6, abs=1e-6)
        lrs = [s["lr"] for s in got["stats"]]
        assert lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]  # the schedule steps once per update
        for name, tensor in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_first_update_of_every_step_is_exactly_on_policy_and_later_ones_are_not(tiny_model_dirs, tmp_path):
    records = run_train(
        tiny_model_dirs["qwen3"],
        tmp_path / "run",
        "train.num_steps=2",
        "train.updates_per_rollout=4",
        "algorithm.skip_tied_groups=false",  # every step keeps its 4 groups: 4 updates
        "optimizer.lr_decay_style=linear",
        nproc=1,  # the 2-rank split of each update is the hand-driven comparison's (above)
    )
    assert len(records) == 2
    lrs = []
    for record in records:
        assert record["train/update_0/approx_kl"] == 0.0 and record["train/update_0/clip_frac"] == 0.0
        later = range(1, NUM_UPDATES)
        assert all(record[f"train/update_{k}/approx_kl"] != 0.0 for k in later)
        assert any(record[f"train/update_{k}/clip_frac"] > 0.0 for k in later)
        assert f"train/update_{NUM_UPDATES}/loss" not in record
        lrs += [record[f"train/update_{k}/lr"] for k in range(NUM_UPDATES)]
    assert lrs == sorted(lrs, reverse=True) and len(set(lrs)) == len(lrs)  # 8 updates, 8 LR values
