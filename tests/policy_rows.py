"""Micro-batches of random token rows with a per-row advantage, and the plain policy-gradient loss over them: what a
test that drives ``rlrun.megatron.train_step`` directly (no rollout) feeds it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rows:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor


def random_rows(rows: int, seq: int, vocab: int, device: torch.device, gen: torch.Generator) -> Rows:
    """``rows`` sequences of ``seq`` ids below ``vocab``, every target trained, one advantage a row; built on the host
    from ``gen`` and moved to ``device``, as the actor's micro-batches reach ``train_step``."""
    return Rows(
        torch.randint(0, vocab, (rows, seq), generator=gen).to(device),
        torch.arange(seq, device=device).expand(rows, seq),
        torch.ones(rows, seq - 1, device=device),
        torch.randn(rows, 1, generator=gen).expand(rows, seq - 1).contiguous().to(device),
    )


def policy_loss(batch: Rows, logprobs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -(logprobs * batch.advantages * batch.loss_mask).sum(), {}
