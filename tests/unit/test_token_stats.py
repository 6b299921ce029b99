"""Chunked log-probs / entropy with the hand-written backward against torch autograd of log_softmax."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlrun.megatron import token_stats
from rlrun.runtime.dist import free_port

VOCAB, PADDED, TEMPERATURE = 45, 50, 0.7


@pytest.fixture(scope="module")
def group():
    """A real one-rank gloo group: the function all-reduces over the TP group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_p = torch.log_softmax(logits[..., :VOCAB] / TEMPERATURE, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("use_entropy", [True, False])
def test_values_and_gradients_match_autograd(group, monkeypatch, use_entropy):
    monkeypatch.setattr(token_stats, "CHUNK_BYTES", 4 * PADDED * 3)  # 3 tokens per chunk: several chunks per row
    gen = torch.Generator().manual_seed(0)
    full = (3 * torch.randn(2, 8, PADDED, generator=gen)).requires_grad_()
    before = full.detach().clone()
    logits = full[:, :-1]  # the strided view the trainer passes
    targets = torch.randint(0, VOCAB, (2, 7), generator=gen)
    weights = torch.randn(2, 2, 7, generator=gen)

    logprobs, entropy = token_stats.chunked_token_stats(logits, targets, TEMPERATURE, 0, VOCAB, group)
    want_lp, want_ent = reference(logits, targets)
    torch.testing.assert_close(logprobs, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_ent, rtol=1e-5, atol=1e-5)
    assert torch.equal(full.detach(), before)  # fp32 logits are not modified in place

    def loss(lp, ent):
        return (weights[0] * lp).sum() + ((weights[1] * ent).sum() if use_entropy else 0.0)

    (got,) = torch.autograd.grad(loss(logprobs, entropy), full)
    (want,) = torch.autograd.grad(loss(want_lp, want_ent), full)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[..., VOCAB:].abs().max() == 0  # padded vocabulary entries get no gradient
