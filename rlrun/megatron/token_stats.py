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

The stored bf16 logits themselves are still ``[tokens, V_local]`` (9.3 GB at 32K tokens of Qwen3's
vocabulary, plus Megatron's transposed copy). :func:`chunked_head_token_stats` takes the final hidden states
and the output weight instead and projects each chunk itself, in the forward and again in the backward, so
no ``[tokens, V]`` tensor exists at all (``model.lm_head: chunked``, rlrun/megatron/lm_head.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rlrun.kernels.triton_support import triton_available
from rlrun.megatron import wgrad_fusion
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


def chunked_head_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    group,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_token_stats` of the logits ``hidden @ weight.T`` without ever holding them: each token
    chunk's logits are projected from ``hidden [..., H]`` (the final norm's output) by this rank's vocabulary
    slice ``weight [V_local, H]``, reduced to per-token numbers and dropped; the backward projects each chunk
    again and turns its logit gradient straight into the hidden-state and weight gradients. Like Megatron's
    column-parallel output layer, the hidden-state gradient is all-reduced over ``group`` (every TP rank
    holds the whole hidden state).

    ``keep_logits`` (``model.lm_head: chunked_kept``): each chunk's logits are kept from the forward for the
    backward instead of projected again: a quarter of the head's GEMM FLOPs less for ``[tokens, V_local]`` of
    the model's dtype held between the two passes (freed chunk by chunk as the backward goes)."""
    valid = min(max(vocab_size - vocab_start, 0), weight.shape[0])
    return _HeadTokenStats.apply(hidden, weight, targets, temperature, vocab_start, valid, group, keep_logits)


def _pieces(shape: torch.Size, vocab: int) -> list[tuple[int, int, int]]:
    """(row, start, stop) token ranges of ``[rows, tokens, V]`` logits, about ``CHUNK_BYTES`` each; one
    row at a time, so every piece is a contiguous slice even of a strided view (``logits[:, :-1]``)."""
    step = max(1, CHUNK_BYTES // (4 * vocab))
    return [(row, start, min(start + step, shape[1])) for row in range(shape[0]) for start in range(0, shape[1], step)]


ChunkLogits = Callable[[int, int, int], torch.Tensor]
"""``(row, start, stop) -> [stop - start, valid]`` logits of one piece (the model's dtype)."""


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


def _targets(targets: torch.Tensor, vocab_start: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local target ids ``[rows, tokens]`` (clamped into the slice) and whether this rank owns each one."""
    t = (targets if targets.dim() == 2 else targets.unsqueeze(0)) - vocab_start
    owned = (t >= 0) & (t < valid)
    return t.clamp(0, max(valid - 1, 0)), owned


def _forward_stats(chunk_logits: ChunkLogits, pieces, t, owned, temperature: float, group):
    """Per-token ``(log p(t), entropy, log normaliser)`` over ``[rows, tokens]``, one piece of logits at a time
    (:func:`_piece_sums` reduces each piece once its max is known on every TP rank)."""
    stats = torch.zeros(4, *t.shape, dtype=torch.float32, device=t.device)  # m, S, z_t - m, sum e (z - m)
    for row, start, stop in pieces:
        u = chunk_logits(row, start, stop)
        m = u.amax(dim=-1).float() / temperature
        all_reduce(m, group, op=dist.ReduceOp.MAX)
        piece = stats[:, row, start:stop]
        piece[0] = m
        _piece_sums(u, m, t[row, start:stop], owned[row, start:stop], 1.0 / temperature, piece[1:])
    all_reduce(stats[1:], group)  # S, the owner's z_t - m and sum e (z - m) over the vocabulary
    log_sum = stats[1].log()
    return stats[2] - log_sum, log_sum - stats[3] / stats[1], stats[0] + log_sum


def _piece_sums(u: torch.Tensor, m: torch.Tensor, t: torch.Tensor, owned: torch.Tensor, inv_t: float, out) -> None:
    """``out [3, n]`` = this rank's ``S = sum_v e_v``, the owned target's ``z_t - m`` and ``sum_v e_v (z_v - m)``
    of one piece's logits ``u [n, V]``, with ``z - m = u / T - m`` and ``e = exp(z - m)``: one Triton pass on
    CUDA (rlrun.megatron.token_stats_triton), else :func:`_torch_piece_sums`."""
    if _triton_covers(u):
        from rlrun.megatron.token_stats_triton import piece_sums

        piece_sums(u, m, t, owned, inv_t, out)
    else:
        _torch_piece_sums(u, m, t, owned, inv_t, out)


def _torch_piece_sums(u: torch.Tensor, m: torch.Tensor, t: torch.Tensor, owned: torch.Tensor, inv_t: float, out):
    """:func:`_piece_sums` in eager PyTorch: ``torch.add`` with ``alpha = 1 / T`` reads the model-dtype logits
    straight into fp32 (cast, scale and shift in one kernel), and ``e @ z`` sums ``e * z`` without a buffer."""
    z = torch.add(-m.unsqueeze(-1), u, alpha=inv_t)  # z - m, fp32; the logits stay as they are
    e = z.exp()
    out[0] = e.sum(dim=-1)
    out[1] = z.gather(-1, t.unsqueeze(-1)).squeeze(-1) * owned
    out[2] = (e.unsqueeze(-2) @ z.unsqueeze(-1)).reshape(-1)


def _backward_grads(
    chunk_logits: ChunkLogits, pieces, saved, grad_logprobs, grad_entropy, temperature: float, destination
):
    """Write each piece's ``dlogits`` into ``destination(row, start, stop)`` (a ``[stop - start, valid]`` tensor
    of the logits' dtype) and yield ``(row, span, dlogits)``:
    ``(g_lp * onehot(t) - p * (g_lp + g_ent * (log p + entropy))) / temperature``, with the per-token factors
    folded into ``exp(log p) * (A * log p + B)`` plus the target's term (:func:`_piece_grad`)."""
    t, owned, log_normalizer, entropy = saved
    inv_t = 1.0 / temperature
    g_lp = torch.zeros_like(log_normalizer) if grad_logprobs is None else grad_logprobs.reshape(log_normalizer.shape)
    b = -inv_t * g_lp
    a = None
    if grad_entropy is not None:
        g_ent = grad_entropy.reshape(log_normalizer.shape)
        a, b = -inv_t * g_ent, b - inv_t * g_ent * entropy
    target_add = inv_t * g_lp * owned
    for row, start, stop in pieces:
        span = slice(start, stop)
        out = destination(row, start, stop)
        _piece_grad(
            chunk_logits(row, start, stop),
            log_normalizer[row, span],
            None if a is None else a[row, span],
            b[row, span],
            t[row, span],
            target_add[row, span],
            inv_t,
            out,
        )
        yield row, span, out


def _piece_grad(u, log_normalizer, a, b, t, target_add, inv_t: float, out: torch.Tensor) -> None:
    """``out`` = ``exp(log p) * (a * log p + b)`` (``b`` alone when ``a`` is None) plus ``target_add`` at each
    token's target column, ``log p = u / T - log_normalizer``: one Triton pass on CUDA, else
    :func:`_torch_piece_grad`."""
    if _triton_covers(u) and out.stride(-1) == 1:
        from rlrun.megatron.token_stats_triton import piece_grad

        piece_grad(u, log_normalizer, a, b, t, target_add, inv_t, out)
    else:
        _torch_piece_grad(u, log_normalizer, a, b, t, target_add, inv_t, out)


def _torch_piece_grad(u, log_normalizer, a, b, t, target_add, inv_t: float, out: torch.Tensor) -> None:
    """:func:`_piece_grad` in eager PyTorch, in fp32 and rounded to ``out``'s dtype once at the end."""
    log_p = torch.add(-log_normalizer.unsqueeze(-1), u, alpha=inv_t)
    coef = b.unsqueeze(-1)
    if a is not None:
        coef = torch.addcmul(coef, log_p, a.unsqueeze(-1))
    dz = log_p.exp_().mul_(coef)
    dz.scatter_add_(-1, t.unsqueeze(-1), target_add.unsqueeze(-1))
    out.copy_(dz)


def _triton_covers(u: torch.Tensor) -> bool:
    """Whether the Triton passes take this piece (CUDA, unit column stride) and Triton is installed."""
    if not (u.is_cuda and u.dim() == 2 and u.stride(-1) == 1):
        return False
    return triton_available()


class _TokenStats(torch.autograd.Function):
    """Log-probs and entropy of stored logits; the backward writes the logits' gradient piece by piece."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, valid, group):
        if logits.dim() not in (2, 3):
            raise ValueError(f"logits must be [tokens, V] or [rows, tokens, V]; got shape {tuple(logits.shape)}")
        ctx.set_materialize_grads(False)
        x = _rows(logits)
        t, owned = _targets(targets, vocab_start, valid)
        pieces = _pieces(x.shape, x.shape[-1])
        logprobs, entropy, log_normalizer = _forward_stats(
            lambda row, start, stop: x[row, start:stop, :valid], pieces, t, owned, temperature, group
        )
        ctx.save_for_backward(logits, t, owned, log_normalizer, entropy)
        ctx.temperature, ctx.valid = temperature, valid
        return logprobs.reshape(targets.shape), entropy.reshape(targets.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, *saved = ctx.saved_tensors
        x, valid = _rows(logits), ctx.valid
        grad = torch.empty_like(x)
        grad[..., valid:] = 0
        pieces = _pieces(x.shape, x.shape[-1])

        def chunk(row: int, start: int, stop: int) -> torch.Tensor:
            return x[row, start:stop, :valid]

        def into_grad(row: int, start: int, stop: int) -> torch.Tensor:
            return grad[row, start:stop, :valid]

        for _ in _backward_grads(chunk, pieces, saved, grad_logprobs, grad_entropy, ctx.temperature, into_grad):
            pass  # each piece's gradient is written into ``grad`` itself
        return grad.reshape(logits.shape), None, None, None, None, None


class _HeadTokenStats(torch.autograd.Function):
    """:class:`_TokenStats` with the output projection inside: logits exist one piece at a time, forward and
    backward (each piece is projected twice: once per pass, ~1/3 more LM-head FLOPs), or, keeping them, from the
    forward until the backward has used them."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, valid, group, keep_logits=False):
        if hidden.dim() not in (2, 3):
            raise ValueError(f"hidden must be [tokens, H] or [rows, tokens, H]; got shape {tuple(hidden.shape)}")
        ctx.set_materialize_grads(False)
        h, w = _rows(hidden), weight[:valid]
        t, owned = _targets(targets, vocab_start, valid)
        pieces = _pieces(h.shape, weight.shape[0])
        # Kept only where a backward will read them (autograd runs this forward with grad mode off).
        kept: dict[tuple[int, int], torch.Tensor] | None = {} if keep_logits and any(ctx.needs_input_grad[:2]) else None

        def project(row: int, start: int, stop: int) -> torch.Tensor:
            u = h[row, start:stop] @ w.t()
            if kept is not None:
                kept[row, start] = u
            return u

        logprobs, entropy, log_normalizer = _forward_stats(project, pieces, t, owned, temperature, group)
        ctx.save_for_backward(hidden, weight, t, owned, log_normalizer, entropy)
        ctx.temperature, ctx.valid, ctx.group, ctx.kept = temperature, valid, group, kept
        return logprobs.reshape(targets.shape), entropy.reshape(targets.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, *saved = ctx.saved_tensors
        h, w = _rows(hidden), weight[: ctx.valid]
        grad_hidden = torch.empty_like(h)
        # fp32 sum over pieces (one bf16 GEMM per piece): rounding no worse than today's one GEMM over all tokens.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        pieces = _pieces(h.shape, weight.shape[0])
        kept = ctx.kept or {}

        def chunk(row: int, start: int, stop: int) -> torch.Tensor:
            # a kept piece is handed over (and freed once used); projected again without one (or a second backward)
            piece = kept.pop((row, start), None)
            return piece if piece is not None else h[row, start:stop] @ w.t()

        def buffer(row: int, start: int, stop: int) -> torch.Tensor:  # the logits' gradient dtype when unchunked
            return torch.empty(stop - start, ctx.valid, dtype=weight.dtype, device=weight.device)

        for row, span, dz in _backward_grads(
            chunk, pieces, saved, grad_logprobs, grad_entropy, ctx.temperature, buffer
        ):
            grad_hidden[row, span] = dz @ w
            _accumulate_weight_grad(grad_weight[: ctx.valid], dz, h[row, span])
        all_reduce(grad_hidden, ctx.group)  # each TP rank holds d/dh of its vocabulary slice only
        return grad_hidden.reshape(hidden.shape), grad_weight.to(weight.dtype), None, None, None, None, None, None


def _accumulate_weight_grad(grad_weight: torch.Tensor, dz: torch.Tensor, hidden: torch.Tensor) -> None:
    """``grad_weight`` (fp32) ``+= dz^T @ hidden``, the GEMM adding into it: for bf16 pieces on CUDA by the
    mixed-precision ``addmm`` (rlrun/megatron/wgrad_fusion.py), where a separate product and fp32 ``add`` cost a
    1.2 GB write and read of Qwen3-1.7B's ``[V, H]`` a piece."""
    if dz.dtype == grad_weight.dtype:
        grad_weight.addmm_(dz.t(), hidden)
    elif dz.is_cuda and wgrad_fusion.supported():
        wgrad_fusion.accumulate_fp32(grad_weight, dz, hidden)
    else:
        grad_weight += dz.t() @ hidden


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
