"""The reference model loaded from an rlrun checkpoint (``algorithm.ref.path`` + ``ref.step``).

A real CLI run (2 ranks, TP=2, tiny Qwen2) saves steps 1 and 2. Then, on the same layout, a reference
loaded from step 1 must give exactly the log-probs of an actor restored at step 1 by the resume path
(``Checkpointer.restore``, an independent loader: optimizer and RNGs too), differ from step 2's, and
leave the actor's weights as they were; with no step the newest checkpoint (2) is the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_algo_roles_megatron import TEMPERATURE, make_micro_batches
from test_train_loop import run_train

from dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _ref_worker(hf_dir: str, ckpt_dir: str) -> dict:
    from rlrun.config.schema import AlgorithmConfig, CheckpointConfig
    from rlrun.megatron import build_model, compute_logprobs, export_hf_weights, make_optimizer
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.checkpoint import Checkpointer
    from rlrun.trainer.roles import ModelRoles

    torch.set_num_threads(1)
    parallel = init_distributed(tp=2, pp=1, seed=0)
    model = build_model(hf_dir, parallel)
    mbs = make_micro_batches(model.arch.vocab_size)

    def logprobs_of(m):
        """As the roles score them: under the loss mask only (0 elsewhere)."""
        with torch.no_grad():
            return [
                compute_logprobs(m, mb.tokens, mb.position_ids, TEMPERATURE, scored=mb.loss_mask).cpu() for mb in mbs
            ]

    def ref_logprobs(**ref) -> list[torch.Tensor]:
        roles = ModelRoles.create(AlgorithmConfig(kl={"loss_coef": 0.1}, ref=ref), model)
        roles.fill_logprobs(mbs, TEMPERATURE)
        return [mb.ref_logprobs for mb in mbs]

    actor_before, actor_logprobs = dict(export_hf_weights(model)), logprobs_of(model)
    got = {
        "step1": ref_logprobs(path=ckpt_dir, step=1),
        "newest": ref_logprobs(path=ckpt_dir),
        "step1_dir": ref_logprobs(path=str(Path(ckpt_dir) / "step_000001")),
    }
    actor_kept = all(torch.equal(t, actor_before[n]) for n, t in export_hf_weights(model))
    try:
        ref_logprobs(path=ckpt_dir, step=5)
        missing_error = ""
    except ValueError as exc:
        missing_error = str(exc)
    expected = {}
    for step in (1, 2):  # the actor restored by the resume path, on a model of its own
        restored = build_model(hf_dir, parallel)
        optimizer = make_optimizer(restored, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0)
        cfg = CheckpointConfig(dir=ckpt_dir, resume=str(Path(ckpt_dir) / f"step_{step:06d}"))
        assert Checkpointer(cfg, ckpt_dir, parallel).restore(restored, optimizer, None)["step"] == step
        expected[step] = logprobs_of(restored)
    destroy_distributed()
    return {
        "got": got,
        "expected": expected,
        "actor": actor_logprobs,
        "actor_kept": actor_kept,
        "missing_error": missing_error,
    }


def test_ref_from_checkpoint_step_matches_restored_actor(tiny_model_dirs, tmp_path):
    hf_dir = tiny_model_dirs["qwen2"]
    run_train(hf_dir, tmp_path / "run", "train.num_steps=2", "parallel.tp=2", "checkpoint.save_interval=1")
    ckpt_dir = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.glob("step_*")) == ["step_000001", "step_000002"]
    for r in run_distributed(_ref_worker, 2, str(hf_dir), str(ckpt_dir), all_ranks=True):
        got, expected = r["got"], r["expected"]
        assert r["actor_kept"]
        for mb_got1, mb_dir1, mb_new, mb_exp1, mb_exp2, mb_actor in zip(
            got["step1"], got["step1_dir"], got["newest"], expected[1], expected[2], r["actor"], strict=False
        ):
            assert torch.equal(mb_got1, mb_exp1) and torch.equal(mb_dir1, mb_exp1)
            assert torch.equal(mb_new, mb_exp2)
            assert (mb_exp1 - mb_exp2).abs().max() > 1e-4  # the steps' weights differ: the test can fail
            assert (mb_exp1 - mb_actor).abs().max() > 1e-4
        assert "algorithm.ref.step (5)" in r["missing_error"] and "[1, 2]" in r["missing_error"]
