"""Truncated importance sampling (clip / mask at token, sequence and geometric level) and the
train/inference mismatch metrics, against plain-Python loops over ragged rows."""

import math

import pytest
import torch

from rlrun.algo.mismatch import mismatch_terms, tis_weights

MASK = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.float)


def rows():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen) * 2
    rollout = old + torch.randn(3, 5, generator=gen) * 0.8  # ratios well spread around 1
    return old, rollout


def reference_ratio(old, rollout, i, t, level):
    valid = [u for u in range(5) if MASK[i, u] > 0]
    diffs = [old[i, u].item() - rollout[i, u].item() for u in valid]
    if level == "token":
        return math.exp(old[i, t].item() - rollout[i, t].item())
    if level == "sequence":
        return math.exp(sum(diffs))
    return math.exp(sum(diffs) / len(diffs))


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["clip", "mask"])
def test_tis_weights_match_python(mode, level):
    old, rollout = rows()
    out = tis_weights(old, rollout, MASK, mode, level, clip=1.5, clip_low=0.6)
    for i in range(3):
        for t in range(5):
            if MASK[i, t] == 0:
                assert out.weights[i, t] == 0
                continue
            raw = reference_ratio(old, rollout, i, t, level)
            if mode == "clip":
                expected = min(max(raw, 0.6), 1.5)
            else:
                expected = raw if 0.6 <= raw <= 1.5 else 0.0
            assert out.weights[i, t].item() == pytest.approx(expected, rel=1e-5)
            assert out.raw[i, t].item() == pytest.approx(raw, rel=1e-5)
            assert out.bounded[i, t].item() == float(abs(expected - raw) > 1e-9)


def test_sequence_level_mask_drops_the_whole_sequence():
    old = torch.zeros(1, 4)
    rollout = torch.tensor([[0.0, 0.0, -3.0, 0.0]])  # one token with ratio e^3
    mask = torch.ones(1, 4)
    token = tis_weights(old, rollout, mask, "mask", "token", clip=2.0, clip_low=0.5)
    seq = tis_weights(old, rollout, mask, "mask", "sequence", clip=2.0, clip_low=0.5)
    assert token.weights.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert seq.weights.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_tis_weights_carry_no_gradient():
    old = torch.zeros(1, 3, requires_grad=True)
    out = tis_weights(old, torch.full((1, 3), -0.1), torch.ones(1, 3), "clip", "token", 2.0, 0.0)
    assert not out.weights.requires_grad


def test_mismatch_terms():
    train, rollout = torch.tensor([-1.0, -0.2]), torch.tensor([-1.3, -0.2])
    terms = mismatch_terms(train, rollout)
    assert terms["logprob_gap"].tolist() == pytest.approx([0.3, 0.0])
    assert terms["mismatch_k1"].tolist() == pytest.approx([-0.3, 0.0])
    # k3 of KL(rollout || train) with log r = logp_rollout - logp_train = -0.3
    assert terms["mismatch_k3"][0].item() == pytest.approx(math.exp(0.3) - 1 - 0.3, rel=1e-6)
    assert terms["mismatch_k3"][1].item() == 0.0
