"""The critic's clipped value loss (PPO, as slime's ``value_loss`` and OpenRLHF's ``ValueLoss``).

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
    """1.0 where the clipped error was the larger one (the clip was active)."""


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, value_clip: float | None
) -> ValueLossTerms:
    """The formula of the module docstring for ``[B, T]`` tensors and a ``[B, T]`` mask."""
    values = values.float()
    error = (values - returns) ** 2
    if value_clip is None:
        return ValueLossTerms(loss=0.5 * error * mask, clipped=torch.zeros_like(error))
    old_values = old_values.float()
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    clipped_error = (clipped_values - returns) ** 2
    return ValueLossTerms(
        loss=0.5 * torch.maximum(error, clipped_error) * mask, clipped=(clipped_error > error).float() * mask
    )
