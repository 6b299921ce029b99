"""What the actor does with the critic's values: GAE inside the rank's advantage step against a plain
Python loop, and a custom advantage function that reads ``mb.values`` (and the error naming it when it
does not hand back advantages and returns)."""

from __future__ import annotations

import pytest
import torch

from rlrun.algo.rank_advantages import assign_advantages
from rlrun.config.schema import AlgorithmConfig
from rlrun.data.batch import MicroBatch


def ppo_micro_batch(spans: list[tuple[int, int]], scores: list[float], seed: int = 0) -> MicroBatch:
    """Rows with response ``[start, start + length)``; each row's score on its response tokens, random values."""
    mask = torch.zeros(len(spans), 7)
    advantages = torch.zeros(len(spans), 7)
    for i, ((start, length), score) in enumerate(zip(spans, scores, strict=False)):
        mask[i, start : start + length] = 1.0
        advantages[i, start : start + length] = score
    values = torch.randn(len(spans), 7, generator=torch.Generator().manual_seed(seed)) * mask
    return MicroBatch(
        tokens=torch.zeros(len(spans), 8, dtype=torch.long),
        position_ids=torch.arange(8).expand(len(spans), 8),
        loss_mask=mask,
        advantages=advantages,
        rollout_logprobs=torch.zeros_like(mask),
        values=values,
    )


def gae_loop(reward: float, values: list[float], gamma: float, lambd: float) -> tuple[list[float], list[float]]:
    """Textbook GAE over one response: the score arrives on the last token, the state after it is terminal."""
    n = len(values)
    advantages, running = [0.0] * n, 0.0
    for t in reversed(range(n)):
        next_value = values[t + 1] if t + 1 < n else 0.0
        delta = (reward if t == n - 1 else 0.0) + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values, strict=False)]


@pytest.mark.parametrize("gamma, lambd", [(1.0, 0.95), (0.9, 0.5)])
def test_ppo_advantages_are_gae_of_the_critic_values(gamma, lambd):
    spans, scores = [(1, 4), (3, 2), (0, 7)], [1.0, -0.5, 0.25]
    mb = ppo_micro_batch(spans, scores)
    assign_advantages(AlgorithmConfig(advantage_estimator="ppo", gamma=gamma, lambd=lambd), [mb], dp_sum=lambda t: t)
    for i, ((start, length), score) in enumerate(zip(spans, scores, strict=False)):
        span = slice(start, start + length)
        want_adv, want_ret = gae_loop(score, mb.values[i, span].tolist(), gamma, lambd)
        assert mb.advantages[i, span].tolist() == pytest.approx(want_adv, abs=1e-6)
        assert mb.returns[i, span].tolist() == pytest.approx(want_ret, abs=1e-6)
        outside = torch.ones(7, dtype=torch.bool)
        outside[span] = False
        assert mb.advantages[i, outside].abs().sum() == 0 and mb.returns[i, outside].abs().sum() == 0


def test_custom_advantage_sees_values_and_must_return_both(tmp_path):
    hook = tmp_path / "critic_adv.py"
    hook.write_text(
        "def td0(cfg, mb, kl):\n    return mb.advantages - mb.values, mb.advantages\n"
        "def only_advantages(cfg, mb, kl):\n    return mb.advantages - mb.values\n"
    )
    mb = ppo_micro_batch([(2, 3)], [1.0])
    values = mb.values.clone()
    assign_advantages(
        AlgorithmConfig(advantage_estimator="ppo", custom_advantage=f"{hook}:td0"), [mb], dp_sum=lambda t: t
    )
    torch.testing.assert_close(mb.advantages, (mb.loss_mask - values) * mb.loss_mask)
    with pytest.raises(
        ValueError,
        match=r"algorithm.custom_advantage \('.*critic_adv.py:only_advantages'\) must "
        r"return \(advantages, returns\).*returned Tensor.*Expected signature",
    ):
        assign_advantages(
            AlgorithmConfig(advantage_estimator="ppo", custom_advantage=f"{hook}:only_advantages"),
            [ppo_micro_batch([(2, 3)], [1.0])],
            dp_sum=lambda t: t,
        )


def test_ppo_without_values_names_the_missing_critic():
    mb = ppo_micro_batch([(1, 2)], [1.0])
    mb.values = None
    with pytest.raises(RuntimeError, match=r"values \(critic\) missing"):
        assign_advantages(AlgorithmConfig(advantage_estimator="ppo"), [mb], dp_sum=lambda t: t)
