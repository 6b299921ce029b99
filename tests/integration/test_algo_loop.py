"""Every model role and most loss terms at once, through the real CLI under torchrun (2 ranks, tiny
model): GSPO with a k3 KL reward penalty to a reference refreshed every 2 steps, weights synced to the engine
every 3 steps with the old actor kept (the weights the engine holds),
on-policy distillation from a teacher with other weights, TIS, entropy bonus, advantage whitening and
a rollout-data post-process hook. Asserts on metrics.jsonl and on what the hook saw."""

from __future__ import annotations

import json

import pytest

from integration.test_train_loop import run_train

pytestmark = pytest.mark.slow

HOOK = '''
import json
from pathlib import Path

import torch


def record(cfg, step, micro_batches):
    """Append what the hook sees; the advantages must already be per-token and whitened."""
    masks = [mb.loss_mask.bool() for mb in micro_batches]
    advantages = torch.cat([mb.advantages[m] for mb, m in zip(micro_batches, masks)])
    line = {"step": step, "estimator": cfg.advantage_estimator, "tokens": int(advantages.numel()),
            "sum": float(advantages.sum()), "sum_sq": float((advantages ** 2).sum()),
            "has_roles": all(mb.ref_logprobs is not None and mb.teacher_logprobs is not None
                             and mb.old_logprobs is not None for mb in micro_batches)}
    with (Path(__file__).parent / "seen.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\\n")
'''


def test_all_roles_and_terms_in_the_loop(tiny_model_dirs, tmp_path):
    from tiny_models import make_tiny_model

    teacher = make_tiny_model("qwen3", tmp_path / "teacher", seed=5)
    (tmp_path / "hook.py").write_text(HOOK)
    records = run_train(
        tiny_model_dirs["qwen3"],
        tmp_path / "run",
        "train.num_steps=3",
        "algorithm.advantage_estimator=gspo",
        "algorithm.eps_clip=0.01",
        "algorithm.normalize_advantages=true",
        "algorithm.kl.reward_coef=0.1",
        "algorithm.kl.estimator=k3",
        "algorithm.ref.update_interval=2",
        "algorithm.keep_old_actor=true",
        "engine.sync_interval=3",
        f"algorithm.opd.teacher_path={teacher}",
        "algorithm.opd.kl_coef=0.2",
        "algorithm.tis.mode=clip",
        "algorithm.tis.clip=2.0",
        "algorithm.entropy_coef=0.001",
        f"algorithm.rollout_data_postprocess={tmp_path / 'hook.py'}:record",
    )
    trained = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in records] == [0, 1, 2] and len(trained) >= 2
    for r in trained:
        assert r["train/reused_logprobs"] == 0.0  # GSPO, KL reward, old actor and OPD all need the old pass
        assert r["train/kl_reward"] >= 0.0 and r["train/kl_ref"] >= 0.0 and r["train/opd_reverse_kl"] != 0.0
        assert 0.0 <= r["train/clip_frac"] <= 1.0 and 0.0 <= r["train/tis_clip_frac"] <= 1.0
        assert abs(r["train/tis_mean"] - 1.0) < 1e-3  # engine and trainer agree: importance ratio ~ 1
        assert r["train/logprob_gap"] < 1e-4
    # engine.sync_interval 3: the engine keeps the initial weights for all 3 steps, and so does the old actor
    # (the gap above stays at round-off): the KL reward is the sampling policy's (the old actor's) against the
    # reference, which starts as the initial actor (KL 0 at steps 0 and 1) and is refreshed after step 1 to
    # the trained weights (KL > 0 at step 2); the policy ratio is 1 exactly at step 0 only
    by_step = {r["step"]: r for r in trained}
    for step, r in by_step.items():
        assert (r["train/abs_log_ratio"] == 0.0) == (step == 0 or sorted(by_step)[0] == step), step
    if 0 in by_step:
        assert by_step[0]["train/kl_reward"] < 1e-6
    if 1 in by_step:
        assert by_step[1]["train/kl_reward"] < 1e-6
    if 2 in by_step and (0 in by_step or 1 in by_step):
        assert by_step[2]["train/kl_reward"] > 1e-6
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert {s["step"] for s in seen} == set(by_step) and all(s["has_roles"] for s in seen)
    for step in by_step:  # whitened over both ranks: mean 0 and (unbiased) variance 1 over the step
        rows = [s for s in seen if s["step"] == step]
        n, total, total_sq = (sum(s[k] for s in rows) for k in ("tokens", "sum", "sum_sq"))
        assert abs(total / n) < 1e-4 and abs((total_sq - total**2 / n) / (n - 1) - 1.0) < 1e-3
