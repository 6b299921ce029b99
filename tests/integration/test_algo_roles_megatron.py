"""Model roles on a real TP=2 Megatron model (gloo, 2 processes):

* reuse path (no old-log-prob forward) and full path give identical loss, gradients and updated weights;
* reference / teacher weights swapped in from CPU backups give the log-probs of a model built from
  their own HF directories, and the actor's weights are back afterwards;
* ``ref.update_interval`` refreshes its backup from the updated actor after the step; ``keep_old_actor``'s
  old actor follows the weights synced to the engine (``on_weights_synced``).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.slow
TEMPERATURE = 0.9


def make_micro_batches(vocab_size: int):
    """Two micro-batches of different shapes with ragged responses and random group scores."""
    from rlrun.data.batch import MicroBatch

    gen = torch.Generator().manual_seed(3)
    batches = []
    for rows, seq, prompt in ((3, 10, 3), (2, 14, 5)):
        tokens = torch.randint(0, vocab_size, (rows, seq), generator=gen)
        mask = torch.zeros(rows, seq - 1)
        for i in range(rows):
            mask[i, prompt - 1 : seq - 1 - i] = 1.0
        scores = torch.randn(rows, 1, generator=gen) * mask
        batches.append(
            MicroBatch(
                tokens=tokens,
                position_ids=torch.arange(seq).expand(rows, seq),
                loss_mask=mask,
                advantages=scores,
                rollout_logprobs=torch.zeros_like(mask),
            )
        )
    return batches


def _step(hf_dir: str, parallel, cfg, reuse: bool) -> dict:
    from rlrun.algo.aggregate import StepCounts
    from rlrun.algo.objective import Objective
    from rlrun.algo.rank_advantages import assign_advantages
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.trainer.roles import ModelRoles

    model = build_model(hf_dir, parallel)
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0)
    roles = ModelRoles.create(cfg, model)
    roles.reuse_logprobs = reuse
    mbs = make_micro_batches(model.arch.vocab_size)
    roles.fill_logprobs(mbs, TEMPERATURE)
    assign_advantages(cfg, mbs, dp_sum=lambda t: t)
    num_tokens = int(sum(mb.loss_mask.sum() for mb in mbs))
    counts = StepCounts(num_tokens=num_tokens, num_samples=5, max_response_len=12)
    out = train_step(model, optimizer, mbs, Objective(cfg, counts), num_tokens, TEMPERATURE, with_entropy=True)
    grads = {name: p.main_grad.detach().clone() for name, p in model.module.named_parameters()}
    return {
        "out": out,
        "grads": grads,
        "weights": dict(export_hf_weights(model)),
        "old_is_none": [mb.old_logprobs is None for mb in mbs],
    }


def _reuse_worker(hf_dir: str) -> dict:
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=2, pp=1, seed=0)
    cfg = AlgorithmConfig(eps_clip=0.1, entropy_coef=0.01, tis={"mode": "clip", "clip": 1.5})
    results = {mode: _step(hf_dir, parallel, cfg, reuse=(mode == "reuse")) for mode in ("reuse", "full")}
    destroy_distributed()
    return results


def test_reuse_and_full_paths_give_identical_loss_and_gradients(tiny_model_dirs):
    results = run_distributed(_reuse_worker, 2, str(tiny_model_dirs["qwen2"]), all_ranks=True)
    for rank_result in results:
        reuse, full = rank_result["reuse"], rank_result["full"]
        assert reuse["old_is_none"] == [True, True] and full["old_is_none"] == [False, False]
        assert reuse["out"] == full["out"]  # loss, grad norm and every metric, bit for bit
        assert reuse["out"]["grad_norm"] > 0
        for name, grad in reuse["grads"].items():
            assert torch.equal(grad, full["grads"][name]), name
        for name, weight in reuse["weights"].items():
            assert torch.equal(weight, full["weights"][name]), name


def _roles_worker(actor_dir: str, ref_dir: str, teacher_dir: str) -> dict:
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.megatron import build_model, compute_logprobs, export_hf_weights, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.roles import ModelRoles

    parallel = init_distributed(tp=2, pp=1, seed=0)

    def logprobs_of(model, mbs):
        """The whole rows' log-probs where the loss reads them, 0 elsewhere: the roles score only those positions."""
        with torch.no_grad():
            full = [compute_logprobs(model, mb.tokens, mb.position_ids, TEMPERATURE).cpu() for mb in mbs]
        return [torch.where(mb.loss_mask != 0, logprobs, 0.0) for mb, logprobs in zip(mbs, full, strict=True)]

    model = build_model(actor_dir, parallel)
    mbs = make_micro_batches(model.arch.vocab_size)
    expected = {
        tag: logprobs_of(build_model(path, parallel), mbs)
        for tag, path in (("actor", actor_dir), ("ref", ref_dir), ("teacher", teacher_dir))
    }
    cfg = AlgorithmConfig(
        kl={"loss_coef": 0.1},
        ref={"path": ref_dir, "update_interval": 1},
        opd={"teacher_path": teacher_dir, "kl_coef": 0.5},
        keep_old_actor=True,
    )
    roles = ModelRoles.create(cfg, model)
    before = dict(export_hf_weights(model))
    roles.fill_logprobs(mbs, TEMPERATURE)
    got = {
        "ref": [mb.ref_logprobs for mb in mbs],
        "teacher": [mb.teacher_logprobs for mb in mbs],
        "actor": [mb.old_logprobs for mb in mbs],
    }
    actor_restored = all(torch.equal(t, before[n]) for n, t in export_hf_weights(model))
    # one optimizer step, then the backups follow the actor (interval 1, keep_old_actor)
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0)

    def pg_loss(mb, logprobs):
        return -(logprobs * mb.advantages.to(logprobs.device) * mb.loss_mask.to(logprobs.device)).sum(), {}

    train_step(model, optimizer, mbs, pg_loss, int(sum(mb.loss_mask.sum() for mb in mbs)), TEMPERATURE)
    roles.after_train_step(step=0)
    updated = logprobs_of(model, mbs)
    roles.fill_logprobs(mbs, TEMPERATURE)
    after = {"ref": [mb.ref_logprobs for mb in mbs], "actor": [mb.old_logprobs for mb in mbs]}
    roles.on_weights_synced()  # the engine now holds the updated weights
    roles.fill_logprobs(mbs, TEMPERATURE)
    after["synced_actor"] = [mb.old_logprobs for mb in mbs]
    destroy_distributed()
    return {"expected": expected, "got": got, "actor_restored": actor_restored, "updated": updated, "after": after}


def test_roles_swap_in_their_own_weights_and_follow_the_actor(tiny_model_dirs, tmp_path_factory):
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("roles")
    ref_dir = make_tiny_model("qwen3", root / "ref", seed=1)
    teacher_dir = make_tiny_model("qwen3", root / "teacher", seed=2)
    result = run_distributed(_roles_worker, 2, str(tiny_model_dirs["qwen3"]), str(ref_dir), str(teacher_dir))
    assert result["actor_restored"]
    for tag in ("actor", "ref", "teacher"):
        for got, expected in zip(result["got"][tag], result["expected"][tag], strict=False):
            assert torch.equal(got, expected), tag
    # the three models really differ, so the swaps are not vacuous
    assert not torch.allclose(result["expected"]["ref"][0], result["expected"]["actor"][0])
    assert not torch.allclose(result["expected"]["teacher"][0], result["expected"]["ref"][0])
    # after the step: ref (update_interval 1) is the updated actor; the old actor (keep_old_actor) stays the
    # weights the engine holds until the next sync, then becomes the updated actor
    after = result["after"]
    for updated, ref, old, synced, initial in zip(
        result["updated"],
        after["ref"],
        after["actor"],
        after["synced_actor"],
        result["expected"]["actor"],
        strict=False,
    ):
        assert torch.equal(ref, updated) and torch.equal(old, initial) and torch.equal(synced, updated)
        assert not torch.allclose(updated, initial)
