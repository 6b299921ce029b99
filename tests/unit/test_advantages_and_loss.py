"""GRPO advantages and the PPO-clip loss against hand-written references."""

import math

import torch

from rlrun.algo.advantages import grpo_advantages, tied_groups
from rlrun.algo.policy_loss import ppo_clip_loss


def test_grpo_advantages_match_formula():
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]])
    adv = grpo_advantages(rewards, normalize_std=True, eps=1e-6)
    group = [1.0, 0.0, 0.5, 0.5]
    mean = sum(group) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / 3)  # unbiased
    expected = [(r - mean) / (std + 1e-6) for r in group]
    assert torch.allclose(adv[0], torch.tensor(expected), atol=1e-6)
    assert torch.equal(adv[1], torch.zeros(4))  # a tied group carries no signal


def test_dr_grpo_only_centres():
    rewards = torch.tensor([[3.0, 1.0]])
    assert torch.equal(grpo_advantages(rewards, normalize_std=False), torch.tensor([[1.0, -1.0]]))


def test_tied_groups():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5]])
    assert tied_groups(rewards).tolist() == [True, False, True]


def test_ppo_clip_loss_cases():
    # ratios: 1.0 (unclipped), e^0.5 (above 1+eps), e^-0.5 (below 1-eps)
    logprobs = torch.tensor([-1.0, -0.5, -1.5, -0.5, -1.5])
    old = torch.full((5,), -1.0)
    adv = torch.tensor([2.0, 1.0, 1.0, -1.0, -1.0])
    terms = ppo_clip_loss(logprobs, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    ratio = torch.exp(logprobs - old)
    expected = []
    for r, a in zip(ratio.tolist(), adv.tolist(), strict=False):
        expected.append(max(-a * r, -a * min(max(r, 0.8), 1.28)))
    assert torch.allclose(terms.loss, torch.tensor(expected), atol=1e-6)
    # positive advantage, ratio above 1+eps_high: clipped; negative advantage, ratio below 1-eps: clipped
    assert terms.clipped.tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert torch.allclose(terms.approx_kl, old - logprobs)


def test_ppo_clip_gradient_is_zero_when_clipped():
    logprobs = torch.tensor([-0.5, -1.0], requires_grad=True)
    terms = ppo_clip_loss(logprobs, torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0]), 0.2, 0.2)
    terms.loss.sum().backward()
    assert logprobs.grad[0] == 0.0  # ratio e^0.5 > 1.2 with A > 0: clipped, no gradient
    assert torch.isclose(logprobs.grad[1], torch.tensor(-1.0))  # d(-A * exp(lp - old))/dlp at ratio 1
