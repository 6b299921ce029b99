"""Advantage estimators against plain-Python references on ragged, masked rows."""

import math
import statistics

import pytest
import torch

from rlrun.algo.advantages import (
    discounted_returns,
    gae,
    group_scores,
    last_token_mask,
    masked_moments,
    reinforce_returns,
    token_advantages,
    whiten,
)
from rlrun.algo.specs import estimator
from rlrun.config.schema import AlgorithmConfig


def scores_of(rewards, name, normalize_std):
    """Rank 0's group scores of estimator ``name`` with the setting ``normalize_std`` (old configs' flat field)."""
    return group_scores(rewards, estimator(AlgorithmConfig(advantage_estimator=name, normalize_std=normalize_std)))


def ragged_batch(seed=0, lengths=((2, 5), (1, 3), (4, 1), (0, 6)), width=12):
    """Rows with a prompt of ``p`` masked positions then ``r`` response positions, right padded.
    Returns (mask, per-row score broadcast over its response, kl, values, rows as (start, r, score))."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(lengths), width)
    scores = torch.zeros(len(lengths), width)
    rows = []
    for i, (p, r) in enumerate(lengths):
        score = float(torch.randn(1, generator=gen))
        mask[i, p : p + r] = 1.0
        scores[i, p : p + r] = score
        rows.append((p, r, score))
    kl = torch.randn(len(lengths), width, generator=gen)
    values = torch.randn(len(lengths), width, generator=gen)
    return mask, scores, kl, values, rows


def test_group_scores_per_estimator():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.25], [2.0, 2.0, 1.0, 3.0]])
    for g, group in enumerate(rewards.tolist()):
        mean, std = statistics.mean(group), statistics.stdev(group)
        for name in ("grpo", "gspo", "cispo"):
            expected = [(r - mean) / (std + 1e-6) for r in group]
            assert scores_of(rewards, name, normalize_std=True)[g].tolist() == pytest.approx(expected, abs=1e-6)
            assert scores_of(rewards, name, normalize_std=False)[g].tolist() == pytest.approx([r - mean for r in group])
        baseline = scores_of(rewards, "reinforce_plus_plus_baseline", normalize_std=True)[g]
        assert baseline.tolist() == pytest.approx([r - mean for r in group])  # never divided by std
        for name in ("reinforce_plus_plus", "ppo"):
            assert scores_of(rewards, name, normalize_std=True)[g].tolist() == group


def test_token_advantages_with_kl_penalty():
    mask, scores, kl, _, rows = ragged_batch()
    adv = token_advantages(scores, mask, kl, kl_coef=0.3)
    for i, (p, r, score) in enumerate(rows):
        for t in range(mask.shape[1]):
            expected = score - 0.3 * kl[i, t].item() if p <= t < p + r else 0.0
            assert adv[i, t].item() == pytest.approx(expected, abs=1e-6)
    assert torch.equal(token_advantages(scores, mask, None, 0.0), scores * mask)


def test_last_token_mask_handles_empty_rows():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.float)
    assert last_token_mask(mask).tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 1, 0]]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_returns_match_python_loop(gamma):
    mask, scores, kl, _, rows = ragged_batch(seed=1)
    returns = reinforce_returns(scores, mask, kl, kl_coef=0.1, gamma=gamma)
    for i, (p, r, score) in enumerate(rows):
        token_rewards = [-0.1 * kl[i, p + j].item() for j in range(r)]
        if r:
            token_rewards[-1] += score
        expected, running = [0.0] * r, 0.0
        for j in reversed(range(r)):
            running = token_rewards[j] + gamma * running
            expected[j] = running
        assert returns[i, p : p + r].tolist() == pytest.approx(expected, abs=1e-5)
        assert returns[i, :p].abs().sum() == 0 and returns[i, p + r :].abs().sum() == 0


@pytest.mark.parametrize("gamma, lambd", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_python_loop(gamma, lambd):
    mask, scores, kl, values, rows = ragged_batch(seed=2)
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    adv, ret = gae(rewards, values, mask, gamma, lambd)
    for i, (p, r, _) in enumerate(rows):
        rs = rewards[i, p : p + r].tolist()
        vs = values[i, p : p + r].tolist()
        expected, last = [0.0] * r, 0.0
        for j in reversed(range(r)):
            next_v = vs[j + 1] if j + 1 < r else 0.0  # terminal after the last response token
            delta = rs[j] + gamma * next_v - vs[j]
            last = delta + gamma * lambd * last
            expected[j] = last
        assert adv[i, p : p + r].tolist() == pytest.approx(expected, abs=1e-5)
        assert ret[i, p : p + r].tolist() == pytest.approx(
            [a + v for a, v in zip(expected, vs, strict=False)], abs=1e-5
        )
        assert adv[i, p + r :].abs().sum() == 0


def test_gae_with_lambda_one_and_zero_values_is_discounted_return():
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    mask = torch.ones(1, 4)
    adv, _ = gae(rewards, torch.zeros(1, 4), mask, gamma=0.5, lambd=1.0)
    assert torch.allclose(adv, discounted_returns(rewards, 0.5))
    assert adv[0, 0].item() == pytest.approx(0.5 * 1 + 0.125 * 2)


def test_whiten_across_ranks_equals_whole_batch_statistics():
    mask, scores, kl, _, rows = ragged_batch(seed=4)
    x = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    valid = [x[i, p + j].item() for i, (p, r, _) in enumerate(rows) for j in range(r)]
    mean, std = statistics.mean(valid), statistics.stdev(valid)
    # two "ranks" holding two rows each: summed moments give the whole batch's statistics
    moments = masked_moments(x[:2], mask[:2]) + masked_moments(x[2:], mask[2:])
    out = torch.cat([whiten(x[:2], mask[:2], moments), whiten(x[2:], mask[2:], moments)])
    expected = [(v - mean) / math.sqrt(std**2 + 1e-8) for v in valid]
    got = [out[i, p + j].item() for i, (p, r, _) in enumerate(rows) for j in range(r)]
    assert got == pytest.approx(expected, abs=1e-5)
    assert (out * (1 - mask)).abs().sum() == 0
    with pytest.raises(ValueError, match="no response token"):
        whiten(x, torch.zeros_like(mask), masked_moments(x, torch.zeros_like(mask)))


def _gae_over_actions(rewards: list[float], values: list[float], gamma: float, lambd: float) -> list[float]:
    """Textbook GAE of one sample whose lists hold only its action tokens (the reference)."""
    out, last = [0.0] * len(rewards), 0.0
    for j in reversed(range(len(rewards))):
        next_v = values[j + 1] if j + 1 < len(rewards) else 0.0
        last = rewards[j] + gamma * next_v - values[j] + gamma * lambd * last
        out[j] = last
    return out


@pytest.mark.parametrize("gamma, lambd", [(1.0, 0.95), (0.99, 0.9), (1.0, 1.0)])
def test_gae_skips_tool_spans_inside_a_response(gamma, lambd):
    """A multi-turn response: 4 action tokens, 64 tool tokens, 4 action tokens, reward 1 at the end,
    V = 0.5. GAE over the action tokens only; before the fix the tool-calling token got delta = r - V
    (-0.466 at gamma 1, lambda 0.95) because every masked position still applied gamma * lambda."""
    mask = torch.tensor([[1.0] * 4 + [0.0] * 64 + [1.0] * 4 + [0.0] * 3])  # 3 pad positions after the end
    values = torch.full(mask.shape, 0.5) * mask + 7.0 * (1 - mask)  # garbage values outside the mask
    rewards = torch.zeros(mask.shape)
    rewards[0, 71] = 1.0
    adv, ret = gae(rewards, values, mask, gamma, lambd)
    actions = [i for i in range(mask.shape[1]) if mask[0, i] > 0]
    want = _gae_over_actions([rewards[0, i].item() for i in actions], [0.5] * 8, gamma, lambd)
    assert [adv[0, i].item() for i in actions] == pytest.approx(want, abs=1e-6)
    assert adv[0, 3].item() > 0  # the tool-calling token
    assert (adv * (1 - mask)).abs().sum() == 0 and (ret * (1 - mask)).abs().sum() == 0
