"""RLOO (``algorithm.advantage_estimator: rloo``): the leave-one-out baseline against a plain-Python
reference, from rank 0's group scores to the per-token advantages a rank trains on."""

import pytest
import torch

from rlrun.algo import specs
from rlrun.algo.advantages import group_scores, score_groups
from rlrun.algo.rank_advantages import assign_advantages
from rlrun.config.schema import AlgorithmConfig
from rlrun.data.batch import MicroBatch
from rlrun.trainer.roles import can_reuse_logprobs


def scores_of(rewards, name, normalize_std):
    return group_scores(
        rewards, specs.estimator(AlgorithmConfig(advantage_estimator=name, normalize_std=normalize_std))
    )


def reference_rloo(group: list[float]) -> list[float]:
    """r_i minus the mean of the other rewards of the group; a lone response keeps its reward."""
    if len(group) == 1:
        return list(group)
    return [r - sum(group[:i] + group[i + 1 :]) / (len(group) - 1) for i, r in enumerate(group)]


@pytest.mark.parametrize("group_size", [1, 2, 3, 8])
def test_group_scores_match_the_reference(group_size):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.rand(5, group_size, generator=gen).round(decimals=1)
    for normalize_std in (True, False):  # the leave-one-out baseline never divides by a std
        scores = scores_of(rewards, "rloo", normalize_std)
        for got, group in zip(scores.tolist(), rewards.tolist(), strict=True):
            assert got == pytest.approx(reference_rloo(group), abs=1e-6)


def test_not_the_grpo_or_mean_baseline():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    rloo = scores_of(rewards, "rloo", normalize_std=False)[0]
    mean = scores_of(rewards, "reinforce_plus_plus_baseline", normalize_std=False)[0]
    assert rloo.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert rloo.tolist() == pytest.approx((mean * 4 / 3).tolist())  # n / (n - 1) times the mean-centred reward


def test_rloo_from_rank0_scores_to_token_advantages():
    cfg = AlgorithmConfig(advantage_estimator="rloo", kl={"reward_coef": 0.1, "estimator": "k1"})
    assert specs.policy_loss(cfg).entry.name == "ppo_clip" and not specs.estimator(cfg).entry.needs_critic
    assert can_reuse_logprobs(AlgorithmConfig(advantage_estimator="rloo"))
    rewards = torch.tensor([[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]])
    scored = score_groups(cfg, rewards)
    assert scored.keep.tolist() == [True, False]  # the tied group carries no signal under RLOO either
    expected = reference_rloo([1.0, 0.5, 0.0])
    lengths = [(0, 3), (2, 2), (1, 4)]
    mask, scores = torch.zeros(3, 6), torch.zeros(3, 6)
    for i, (p, r) in enumerate(lengths):
        mask[i, p : p + r] = 1
        scores[i, p : p + r] = scored.scores[0, i]
    gen = torch.Generator().manual_seed(0)
    old, ref = (-torch.rand(3, 6, generator=gen) for _ in range(2))
    mb = MicroBatch(
        tokens=torch.zeros(3, 7, dtype=torch.long),
        position_ids=torch.arange(7).expand(3, 7),
        loss_mask=mask,
        advantages=scores,
        rollout_logprobs=torch.zeros_like(mask),
        old_logprobs=old,
        ref_logprobs=ref,
    )
    assign_advantages(cfg, [mb], dp_sum=lambda t: t)
    for i, (p, r) in enumerate(lengths):
        for t in range(6):
            want = expected[i] - 0.1 * (old[i, t] - ref[i, t]).item() if p <= t < p + r else 0.0
            assert mb.advantages[i, t].item() == pytest.approx(want, abs=1e-6)
    assert torch.equal(mb.returns, mb.advantages)
