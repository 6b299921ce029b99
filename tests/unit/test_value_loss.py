"""The clipped value loss against numbers worked out by hand, and its gradient where the clip is active."""

from __future__ import annotations

import pytest
import torch

from rlrun.algo.value_loss import clipped_value_loss


def test_clipped_value_loss_matches_hand_computed_cases():
    # old 0.0, clip 0.2, per token (V, R):
    #   (0.1, 1.0)  inside the clip:  max(0.81, 0.81)                  -> 0.405, not clipped
    #   (0.5, 1.0)  moved past +0.2:  max(0.25, (0.2-1)^2 = 0.64)      -> 0.32,  clipped (pessimistic)
    #   (0.5, 0.0)  moved past +0.2:  max(0.25, 0.04)                  -> 0.125, not clipped
    #   (-0.6, 0.0) moved past -0.2:  max(0.36, 0.04)                  -> 0.18,  not clipped
    #   (-0.6, -1.0) past -0.2:       max(0.16, (-0.2+1)^2 = 0.64)     -> 0.32,  clipped
    #   masked token                                                    -> 0
    values = torch.tensor([[0.1, 0.5, 0.5, -0.6, -0.6, 3.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0, 0.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    terms = clipped_value_loss(values, torch.zeros_like(values), returns, mask, value_clip=0.2)
    torch.testing.assert_close(terms.loss, torch.tensor([[0.405, 0.32, 0.125, 0.18, 0.32, 0.0]]))
    torch.testing.assert_close(terms.clipped, torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]]))


def test_unclipped_value_loss_is_half_squared_error():
    values, returns, old = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 0.0]])
    terms = clipped_value_loss(values, old, returns, torch.ones(1, 2), value_clip=None)
    torch.testing.assert_close(terms.loss, torch.tensor([[2.0, 2.0]]))
    assert terms.clipped.sum() == 0


@pytest.mark.parametrize("value, expected_grad", [(0.1, 0.1 - 1.0), (0.5, 0.0)])
def test_gradient_vanishes_only_where_the_clipped_error_wins(value, expected_grad):
    # inside the clip: d/dV 0.5 (V - R)^2 = V - R; past it, the clipped branch is constant in V
    values = torch.tensor([[value]], requires_grad=True)
    terms = clipped_value_loss(values, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), value_clip=0.2)
    terms.loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[expected_grad]]))


def test_tokens_inside_the_clip_are_never_counted_as_clipped():
    """Random fp32 values within the clip of non-zero old values: V_old + (V - V_old) rounds away from V on some
    tokens, which a plain ``clipped_error > error`` counted as clipped (0.4-1.1% of tokens before the fix)."""
    g = torch.Generator().manual_seed(0)
    old = (torch.rand(64, 512, generator=g) * 2 - 1) * 0.09  # old and new values in (-0.09, 0.09), as a fresh
    values = (torch.rand(64, 512, generator=g) * 2 - 1) * 0.09  # critic's: |V - V_old| < 0.2 everywhere
    returns = torch.randn(64, 512, generator=g)
    terms = clipped_value_loss(values, old, returns, torch.ones(64, 512), value_clip=0.2)
    assert terms.clipped.sum() == 0
    torch.testing.assert_close(terms.loss, 0.5 * (values - returns) ** 2, rtol=0, atol=0)
