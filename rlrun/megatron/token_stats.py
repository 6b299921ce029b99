"""Vocab-parallel log-probs and entropy in token chunks, with a hand-written backward.

The autograd version of these formulas (``rlrun.megatron.logprobs`` docstring) keeps several fp32
copies of the ``[tokens, V_local]`` logits alive for the backward pass (the fp32 cast, ``exp``,
``exp * z``): at 16K tokens and Qwen3's 152K vocabulary each is 10 GB, and every elementwise pass over
them costs HBM time. Here the forward walks the tokens in chunks of about ``CHUNK_BYTES`` of fp32 and
keeps only per-token numbers (``log_normalizer``, entropy); the backward recomputes each chunk's
probabilities from the (already stored) logits and writes the gradient directly:

    p_v            = exp(z_v - log_normalizer)                     (z = logits / temperature)
    d logp_t / dz  = onehot(t) - p
    d entropy / dz = -p * (log p + entropy)
    d / dlogits    = (g_logp * d logp_t / dz + g_entropy * d entropy / dz) / temperature

Every TP rank computes the same loss, so each rank's local gradient is exactly the formula above on
its vocabulary slice (the forward all-reduces need no backward communication). Padded vocabulary
entries (ids >= the HF vocab size) sit at the end of the last slices; they are left out of every sum
and get zero gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlrun.runtime.dist import all_reduce

CHUNK_BYTES = 1 << 30
"""fp32 bytes of one chunk's ``[tokens, V_local]`` slice: two such buffers live at a time."""


def chunked_token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_start: int, vocab_size: int, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(targets), entropy)``, float32 of ``targets``' shape, for local logits ``[..., V_local]``
    holding vocabulary ids ``[vocab_start, vocab_start + V_local)``; ``group``: the TP process group."""
    valid = min(max(vocab_size - vocab_start, 0), logits.shape[-1])
    return _TokenStats.apply(logits, targets, temperature, vocab_start, valid, group)


def _pieces(shape: torch.Size, vocab: int) -> list[tuple[int, int, int]]:
    """(row, start, stop) token ranges of ``[rows, tokens, V]`` logits, about ``CHUNK_BYTES`` each; one
    row at a time, so every piece is a contiguous slice even of a strided view (``logits[:, :-1]``)."""
    step = max(1, CHUNK_BYTES // (4 * vocab))
    return [(row, start, min(start + step, shape[1])) for row in range(shape[0]) for start in range(0, shape[1], step)]


class _TokenStats(torch.autograd.Function):
    """Each pass over a chunk reads the bf16 logits straight into fp32 arithmetic (``torch.add`` with
    ``alpha = 1 / temperature`` does the cast, the scaling and the shift in one kernel) and reuses its
    buffers in place: HBM traffic, not FLOPs, is what these loops cost."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, valid, group):
        if logits.dim() not in (2, 3):
            raise ValueError(f"logits must be [tokens, V] or [rows, tokens, V]; got shape {tuple(logits.shape)}")
        ctx.set_materialize_grads(False)
        x = logits if logits.dim() == 3 else logits.unsqueeze(0)
        t = (targets if targets.dim() == 2 else targets.unsqueeze(0)) - vocab_start
        owned = (t >= 0) & (t < valid)
        t = t.clamp(0, max(valid - 1, 0))
        stats = torch.zeros(4, *x.shape[:2], dtype=torch.float32, device=x.device)  # m, S, z_t - m, sum e (z - m)
        for row, start, stop in _pieces(x.shape, x.shape[-1]):
            u = x[row, start:stop, :valid]
            m = u.amax(dim=-1).float() / temperature
            all_reduce(m, group, op=dist.ReduceOp.MAX)
            z = torch.add(-m.unsqueeze(-1), u, alpha=1.0 / temperature)  # z - m, fp32; the logits stay as they are
            e = z.exp()
            piece = stats[:, row, start:stop]
            piece[0], piece[1] = m, e.sum(dim=-1)
            piece[2] = z.gather(-1, t[row, start:stop].unsqueeze(-1)).squeeze(-1) * owned[row, start:stop]
            piece[3] = (e.unsqueeze(-2) @ z.unsqueeze(-1)).reshape(-1)  # sum_v e_v (z_v - m), without an e * z buffer
        all_reduce(stats[1:], group)  # S, the owner's z_t - m and sum e (z - m) over the vocabulary
        log_sum = stats[1].log()
        logprobs, entropy = stats[2] - log_sum, log_sum - stats[3] / stats[1]
        log_normalizer = stats[0] + log_sum
        ctx.save_for_backward(logits, t, owned, log_normalizer, entropy)
        ctx.temperature, ctx.valid = temperature, valid
        shape = targets.shape
        return logprobs.reshape(shape), entropy.reshape(shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        """``dlogits = (g_lp * onehot(t) - p * (g_lp + g_ent * (log p + entropy))) / temperature``, with the
        per-token factors folded into ``A * log p + B`` so each chunk takes one fused multiply-add."""
        logits, t, owned, log_normalizer, entropy = ctx.saved_tensors
        x = logits if logits.dim() == 3 else logits.unsqueeze(0)
        inv_t = 1.0 / ctx.temperature
        grad = torch.empty_like(x)
        grad[..., ctx.valid :] = 0
        g_lp = (
            torch.zeros_like(log_normalizer) if grad_logprobs is None else grad_logprobs.reshape(log_normalizer.shape)
        )
        b = -inv_t * g_lp
        if grad_entropy is not None:
            g_ent = grad_entropy.reshape(log_normalizer.shape)
            a, b = -inv_t * g_ent, b - inv_t * g_ent * entropy
        for row, start, stop in _pieces(x.shape, x.shape[-1]):
            span = slice(start, stop)
            log_p = torch.add(-log_normalizer[row, span].unsqueeze(-1), x[row, span, : ctx.valid], alpha=inv_t)
            coef = b[row, span].unsqueeze(-1)
            if grad_entropy is not None:
                coef = torch.addcmul(coef, log_p, a[row, span].unsqueeze(-1))
            dz = log_p.exp_().mul_(coef)
            dz.scatter_add_(-1, t[row, span].unsqueeze(-1), (inv_t * g_lp[row, span] * owned[row, span]).unsqueeze(-1))
            grad[row, span, : ctx.valid] = dz
        return grad.reshape(logits.shape), None, None, None, None, None


def kept_set_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    kept_ids: torch.Tensor,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    group,
) -> torch.Tensor:
    """Top-p mask replay: ``log p(target)`` renormalised over each position's kept set,
    ``z_t - log sum_{k in kept} exp(z_k)`` with ``z = logits / temperature``; float32 of ``targets``' shape.

    ``kept_ids`` is ``[..., K]`` of ``targets``' leading shape, -1 padded (``MicroBatch.kept_ids``); positions
    whose set is empty give NaN-free garbage (callers select them away). Vocabulary-parallel like
    :func:`chunked_token_stats`: each TP rank gathers the kept and target logits it owns, and the sums are
    all-reduced; every rank computes the same loss, so the local gradient (autograd through the gathers:
    ``onehot(t) - softmax over the kept set``, on this rank's ids) needs no backward communication.
    The gathers touch K logits per position, but their backward writes one zero-filled buffer of the logits'
    size (sparse only in its nonzeros).
    """
    valid = min(max(vocab_size - vocab_start, 0), logits.shape[-1])
    local = kept_ids - vocab_start
    owned = (kept_ids >= 0) & (local >= 0) & (local < valid)
    z = logits.gather(-1, local.clamp(0, max(valid - 1, 0))).float() / temperature
    z = z.masked_fill(~owned, float("-inf"))
    m = z.detach().amax(dim=-1)
    all_reduce(m, group, op=dist.ReduceOp.MAX)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    local_sum = (z - m.unsqueeze(-1)).exp().sum(dim=-1)
    log_mass = m + _summed_over_ranks(local_sum, group).clamp(min=torch.finfo(torch.float32).tiny).log()
    t = targets - vocab_start
    t_owned = (t >= 0) & (t < valid)
    z_t = logits.gather(-1, t.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1).float() / temperature
    return _summed_over_ranks(z_t * t_owned, group) - log_mass


def _summed_over_ranks(local: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``local`` over the TP ranks, differentiable in this rank's term only (module docstring)."""
    total = local.detach().clone()
    all_reduce(total, group)
    return local + (total - local.detach())
