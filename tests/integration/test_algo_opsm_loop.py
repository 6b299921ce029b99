"""OPSM in the loop, through the real CLI under torchrun (2 ranks, tiny model): the engine keeps its weights
for two steps (the old actor with it), so from the second step the policy that sampled is one update behind
the trained one. Asserts on metrics.jsonl: step 0 is on-policy and masks nothing; the masked fraction is
logged every step and stays a fraction."""

from __future__ import annotations

import pytest

from integration.test_train_loop import run_train

pytestmark = pytest.mark.slow


def test_opsm_trains_and_masks_only_off_policy(tiny_model_dirs, tmp_path):
    records = run_train(
        tiny_model_dirs["qwen3"],
        tmp_path / "run",
        "train.num_steps=3",
        "algorithm.policy_loss={name: opsm, delta: 1.0e-3}",
        "algorithm.keep_old_actor=true",
        "engine.sync_interval=2",
    )
    trained = {r["step"]: r for r in records if "train/loss" in r}
    assert len(trained) >= 2, records
    for r in trained.values():
        assert 0.0 <= r["train/opsm_masked"] <= 1.0
        assert r["train/logprob_gap"] < 1e-4  # the engine and the old actor hold the same weights
    first = min(trained)
    assert trained[first]["train/opsm_masked"] == 0.0  # on-policy: no sequence has drifted
    print({step: (r["train/opsm_masked"], r["train/abs_log_ratio"]) for step, r in trained.items()})
