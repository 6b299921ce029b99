"""Advantage estimators over groups of responses to the same prompt."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, arXiv 2402.03300).

    ``rewards`` is ``[num_groups, group_size]``; each response's advantage is

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     if normalize_std
        A_i =  r_i - mean(r_group)                             otherwise (Dr.GRPO, arXiv 2503.20783)

    with the unbiased std (as slime and TRL use). Every token of a response gets its A_i.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
    return centred / (std + eps)


def tied_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool ``[num_groups]``: groups whose rewards are all equal (they carry no GRPO signal)."""
    return (rewards == rewards[:, :1]).all(dim=1)
