"""On a GPU, the Triton passes of the trainer's log-prob/entropy statistics (rlrun/megatron/token_stats_triton.py)
compute what the eager passes compute (the CPU path, tests/unit/test_token_stats.py), and the chunked LM head
built on them matches fp32 autograd through ``log_softmax``.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_token_stats_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The statistics ask the group's size before each all-reduce (skipped on one rank)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29563", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("rows", "vocab", "valid"), [(37, 151936, 151669), (5, 1000, 1000), (1, 4097, 4000)])
def test_triton_passes_equal_the_eager_ones(rows, vocab, valid):
    from rlrun.megatron import token_stats
    from rlrun.megatron.token_stats_triton import piece_grad, piece_sums

    g = torch.Generator(device="cuda").manual_seed(0)
    stored = (4 * torch.randn(rows, vocab, device="cuda", generator=g)).bfloat16()
    u = stored[:, :valid]  # a strided piece, as the stored-logits path slices off padded vocabulary
    inv_t = 1 / 0.7
    m = u.amax(dim=-1).float() * inv_t
    t = torch.randint(0, valid, (rows,), device="cuda", generator=g)
    owned = torch.rand(rows, device="cuda", generator=g) > 0.3
    got, want = torch.zeros(3, rows, device="cuda"), torch.zeros(3, rows, device="cuda")
    piece_sums(u, m, t, owned, inv_t, got)
    token_stats._torch_piece_sums(u, m, t, owned, inv_t, want)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert torch.all(got[1][~owned] == 0)

    log_normalizer = m + want[0].log()
    a, b = torch.randn(rows, device="cuda", generator=g), torch.randn(rows, device="cuda", generator=g)
    target_add = torch.randn(rows, device="cuda", generator=g) * owned
    for coef_a in (a, None):
        got_grad = torch.empty(rows, valid, dtype=torch.bfloat16, device="cuda")
        want_grad = torch.empty_like(got_grad)
        piece_grad(u, log_normalizer, coef_a, b, t, target_add, inv_t, got_grad)
        token_stats._torch_piece_grad(u, log_normalizer, coef_a, b, t, target_add, inv_t, want_grad)
        # fp32 in both, rounded to bf16 once: one bf16 step apart at most, where exp's last bits differ
        torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=2**-6, atol=1e-30)


@pytest.mark.parametrize("head", ["chunked", "chunked_kept", "logits"])
def test_chunked_statistics_match_log_softmax_autograd(head, monkeypatch):
    """Forward and gradients against fp32 autograd; pieces small enough that a row spans several. The chunked
    head's weight gradient is summed by the mixed-precision ``addmm`` here (bf16 on CUDA)."""
    from rlrun.megatron import token_stats

    monkeypatch.setattr(token_stats, "CHUNK_BYTES", 4 * 50000 * 7)  # 7 tokens a piece
    g = torch.Generator(device="cuda").manual_seed(1)
    rows, tokens, hidden, vocab, valid, temperature = 2, 30, 64, 50000, 49990, 0.8
    h = (torch.randn(rows, tokens, hidden, device="cuda", generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.3).bfloat16().requires_grad_()
    targets = torch.randint(0, valid, (rows, tokens), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(rows, tokens, device="cuda", generator=g), torch.randn(rows, tokens, device="cuda")

    if head != "logits":
        keep = head == "chunked_kept"
        logp, ent = token_stats.chunked_head_token_stats(h, w, targets, temperature, 0, valid, None, keep)
    else:
        logp, ent = token_stats.chunked_token_stats(h @ w.t(), targets, temperature, 0, valid, None)
    grads = torch.autograd.grad((logp * g_lp).sum() + (ent * g_ent).sum(), [h, w])

    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    log_p = torch.log_softmax((h32 @ w32[:valid].t()) / temperature, dim=-1)
    ref_logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    ref_grads = torch.autograd.grad((ref_logp * g_lp).sum() + (ref_ent * g_ent).sum(), [h32, w32])
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=0.05)  # the bf16 logits of the forward
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=0.05)
    for got, want in zip(grads, ref_grads, strict=True):
        err = (got.float() - want).norm() / want.norm()
        assert err < 0.03, f"relative gradient error {err:.3g}"


def test_kept_logits_are_the_recomputed_ones_bit_for_bit(monkeypatch):
    """``model.lm_head: chunked_kept`` changes no number: the backward's logits are the forward's GEMM either way."""
    from rlrun.megatron import token_stats

    monkeypatch.setattr(token_stats, "CHUNK_BYTES", 4 * 151936 * 300)  # 300 tokens a piece
    g = torch.Generator(device="cuda").manual_seed(2)
    h0 = torch.randn(1000, 2048, device="cuda", generator=g).bfloat16()
    w0 = (torch.randn(151936, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    targets = torch.randint(0, 151669, (1000,), device="cuda", generator=g)
    g_lp = torch.randn(1000, device="cuda", generator=g)
    results = []
    for keep in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logp, ent = token_stats.chunked_head_token_stats(h, w, targets, 1.0, 0, 151669, None, keep)
        results.append((logp, ent, *torch.autograd.grad((logp * g_lp).sum() + ent.sum(), [h, w])))
    for recomputed, kept in zip(*results, strict=True):
        assert torch.equal(recomputed, kept)
