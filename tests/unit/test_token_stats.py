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


def test_head_over_no_tokens_gives_empty_stats_and_zero_gradients(group):
    """The train step scores only loss-masked positions (rlrun.megatron.logprobs._scored_positions): a micro-batch
    without any is a ``[0, H]`` hidden state, whose head must neither fail nor add gradient."""
    hidden = torch.randn(0, 6, requires_grad=True)
    weight = torch.randn(PADDED, 6, requires_grad=True)
    targets = torch.zeros(0, dtype=torch.long)
    logprobs, entropy = token_stats.chunked_head_token_stats(hidden, weight, targets, TEMPERATURE, 0, VOCAB, group)
    assert logprobs.shape == entropy.shape == (0,)
    grad_hidden, grad_weight = torch.autograd.grad((logprobs.sum() + entropy.sum()), (hidden, weight))
    assert grad_hidden.shape == (0, 6) and torch.count_nonzero(grad_weight) == 0


class _MatmulCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the GEMMs dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_kept_logits_give_the_same_numbers_without_projecting_again(group, monkeypatch):
    """``model.lm_head: chunked_kept``: the backward reads the forward's logits instead of projecting each chunk
    again, so it runs one GEMM a chunk fewer, with the same log-probs, entropies and gradients."""
    monkeypatch.setattr(token_stats, "CHUNK_BYTES", 4 * PADDED * 3)  # 3 tokens a chunk: 4 chunks of 11 tokens
    gen = torch.Generator().manual_seed(1)
    hidden0, weight0 = torch.randn(11, 6, generator=gen), torch.randn(PADDED, 6, generator=gen)
    targets = torch.randint(0, VOCAB, (11,), generator=gen)
    weights = torch.randn(2, 11, generator=gen)
    got, gemms = {}, {}
    for keep in (False, True):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        lp, ent = token_stats.chunked_head_token_stats(hidden, weight, targets, TEMPERATURE, 0, VOCAB, group, keep)
        with _MatmulCount() as count:
            grads = torch.autograd.grad((weights[0] * lp).sum() + (weights[1] * ent).sum(), (hidden, weight))
        got[keep], gemms[keep] = (lp, ent, *grads), count.calls
    for kept, recomputed in zip(got[True], got[False], strict=True):
        assert torch.equal(kept, recomputed)
    assert gemms == {False: 3 * 4, True: 2 * 4}  # per chunk: (projection,) hidden gradient, weight gradient


def test_a_loss_mask_of_the_wrong_shape_is_named():
    """The scored positions come from the micro-batch's loss mask, one per predicted token: ``[rows, tokens - 1]``."""
    from rlrun.megatron.logprobs import _scored_positions

    tokens, output = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, 4)
    with pytest.raises(ValueError, match=r"loss_mask must be \[rows, tokens - 1\] = \[2, 8\].*got \[2, 9\]"):
        _scored_positions(None, output, tokens, torch.ones(2, 9), TEMPERATURE, False)
