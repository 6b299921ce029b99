"""The check shared by the CPU and GPU tests of the flat optimizer state (rlrun/trainer/optimizer_state.py): AdamW
steps taken through a FlatOptimizerState equal those of a plain AdamW over twin parameters, bit for bit."""

from __future__ import annotations

import torch


def assert_same_as_plain_adamw(state, optimizer: torch.optim.Optimizer, reference: torch.optim.Optimizer) -> None:
    """``optimizer``'s parameters and moments (held by ``state``: its weights and both moments, fp32) equal
    ``reference``'s, which stepped alike without one."""
    params, twins = optimizer.param_groups[0]["params"], reference.param_groups[0]["params"]
    assert state.nbytes == 3 * 4 * sum(p.numel() for p in params)
    for param, twin in zip(params, twins, strict=True):
        assert torch.equal(param, twin)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], reference.state[twin][key]), key
