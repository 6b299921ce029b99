"""The critic's clipped value loss (PPO, as verl's ``compute_value_loss`` and OpenRLHF's ``ValueLoss``; slime's
``value_loss`` is the same without the 0.5 factor, so its value gradients are twice these).

Per token, with ``V`` the critic's new values, ``V_old`` the values it produced before this update
(the ones GAE used) and ``R`` the GAE returns::

    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
    loss_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

The max makes the update pessimistic: moving the value further than ``value_clip`` from ``V_old``
earns no extra reduction of the loss. ``value_clip=None`` gives the plain ``0.5 * (V - R)^2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ValueLossTerms:
    """Per-token tensors, zero outside the mask."""

    loss: torch.Tensor
    """0.5 * the pessimistic squared error."""
    clipped: torch.Tensor
    """1.0 where the clip was active: ``|V - V_old| > value_clip`` and the clipped error the larger one."""


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, value_clip: float | None
) -> ValueLossTerms:
    """The formula of the module docstring for ``[B, T]`` tensors and a ``[B, T]`` mask."""
    values = values.float()
    error = (values - returns) ** 2
    if value_clip is None:
        return ValueLossTerms(loss=0.5 * error * mask, clipped=torch.zeros_like(error))
    old_values = old_values.float()
    change = values - old_values
    clipped_error = (old_values + change.clamp(-value_clip, value_clip) - returns) ** 2
    # Where the clamp is inactive, V_old + (V - V_old) differs from V by rounding only, so the two errors are
    # compared only where it binds (a strict > on all tokens would count unclipped tokens as clipped by rounding).
    active = (change.abs() > value_clip) & (clipped_error > error)
    return ValueLossTerms(loss=0.5 * torch.where(active, clipped_error, error) * mask, clipped=active.float() * mask)
