"""The on-policy gate (``algorithm.max_logprob_gap``, rlrun.trainer.actor.check_on_policy) on given step metrics."""

from __future__ import annotations

import pytest

from rlrun.trainer.actor import OffPolicyError, check_on_policy


def test_gate_off_or_within_bound_passes():
    check_on_policy(None, 3, {"train/logprob_gap": 1.0})
    check_on_policy(1e-6, 3, {"train/logprob_gap": 1e-6, "train/abs_log_ratio": 1e-3})  # ratio checked at step 0
    check_on_policy(1e-6, 0, {"train/logprob_gap": 0.0, "train/abs_log_ratio": 0.0, "train/approx_kl": 0.0})
    check_on_policy(1e-6, 0, {"rollout/reward_mean": 0.5})  # a step that did not train


@pytest.mark.parametrize("gap", [2e-6, float("nan")])
def test_gap_over_the_bound_names_the_step_and_the_gap(gap):
    with pytest.raises(OffPolicyError, match=r"train/logprob_gap at step 7 \((2e-06|nan) nats per token\) must be <= "):
        check_on_policy(1e-6, 7, {"train/logprob_gap": gap})


def test_step_zero_needs_an_exact_ratio_and_zero_kl():
    with pytest.raises(OffPolicyError, match="at step 0 the policy ratio must be exactly 1"):
        check_on_policy(1e-6, 0, {"train/logprob_gap": 0.0, "train/abs_log_ratio": 1e-9, "train/approx_kl": 0.0})
    with pytest.raises(OffPolicyError, match="approx_kl 1e-09"):
        check_on_policy(1e-6, 0, {"train/logprob_gap": 0.0, "train/abs_log_ratio": 0.0, "train/approx_kl": 1e-9})
