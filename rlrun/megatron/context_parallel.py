"""Context parallelism (``cp`` ranks share one sequence) through rlrun's own core attention: works on gloo too.

Megatron's CP attention needs TransformerEngine; here each CP rank keeps its share of the tokens, gathers every
rank's keys and values (all-gather), and attends its queries causally to the keys before them. Layout, the one
Megatron's RoPE already expects (``get_pos_emb_on_this_cp_rank``): a row of ``S`` tokens (padded to a multiple
of ``2 cp``) is cut into ``2 cp`` chunks of ``c = S / (2 cp)``; rank ``r`` holds chunks ``r`` and ``2cp-1-r``, so
every rank has the same causal work (one early chunk, one late). Query chunk ``g`` attends keys ``[0, (g+1) c)``
with the causal diagonal at its bottom right.

Gradients: the all-gather's backward sums every rank's key/value gradients and keeps this rank's chunks. The
log-probs and entropies are gathered back to the whole row on every CP rank (:func:`gather_positions`), so the
loss function sees the same ``[B, S-1]`` tensors as without CP and every CP rank computes the same loss; the
gather's backward keeps this rank's positions only, so each rank's parameter gradient is its own tokens' share
and Megatron DDP's sum over the data- and context-parallel ranks is the whole gradient.

Only unpacked rows (one sample per row, positions ``0..S-1``) are split; packed rows are refused (their
per-sample chunking is TransformerEngine's ``thd`` CP). Memory: the gathered keys/values are ``cp`` times a rank's
share per layer, freed after the layer (kept for the backward only through the core attention's saved inputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlrun.kernels import attention as attention_kernel


def _group():
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_group()


def cp_size() -> int:
    from megatron.core import parallel_state as mpu

    return mpu.get_context_parallel_world_size()


def _chunk_order(size: int) -> list[int]:
    """Global chunk indices in all-gather order: rank 0's two chunks, then rank 1's, ..."""
    return [g for rank in range(size) for g in (rank, 2 * size - 1 - rank)]


def padded_length(length: int, size: int) -> int:
    return -(-length // (2 * size)) * (2 * size)


def shard(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of ``tensor`` along ``dim`` (zero-padded to a multiple of ``2 cp``)."""
    size, rank = cp_size(), dist.get_rank(_group())
    length = tensor.shape[dim]
    pad = padded_length(length, size) - length
    if pad:
        shape = list(tensor.shape)
        shape[dim] = pad
        tensor = torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)
    chunks = tensor.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


class _GatherPositions(torch.autograd.Function):
    """All-gather of every rank's two chunks along ``dim`` into the whole (padded) row; backward: this rank's
    chunks of the gradient (every CP rank computes the same loss from the gathered row)."""

    @staticmethod
    def forward(ctx, local, dim):
        size = cp_size()
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local.contiguous(), group=_group())
        chunks = [c for piece in pieces for c in piece.chunk(2, dim=dim)]
        ordered = [chunks[_chunk_order(size).index(g)] for g in range(2 * size)]
        ctx.dim = dim
        return torch.cat(ordered, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return shard(grad, ctx.dim), None


def gather_positions(local: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    """The whole row (its first ``length`` positions along ``dim``) from every CP rank's :func:`shard`."""
    return _GatherPositions.apply(local, dim).narrow(dim, 0, length)


class _GatherKV(torch.autograd.Function):
    """All-gather of ``[S_local, ...]`` keys or values in all-gather order; backward: the sum over CP ranks of
    the gathered gradient, this rank's slice (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, local):
        pieces = [torch.empty_like(local) for _ in range(cp_size())]
        dist.all_gather(pieces, local.contiguous(), group=_group())
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=_group())
        rank, local = dist.get_rank(_group()), grad.shape[0] // cp_size()
        return grad[rank * local : (rank + 1) * local]


def attention(query, key, value, scale: float | None, dropout_p: float) -> torch.Tensor:
    """Causal attention of this rank's ``[S_local, B, heads, dim]`` queries over the whole row's keys/values
    (module docstring); output ``[S_local, B, heads * dim]``."""
    size, rank = cp_size(), dist.get_rank(_group())
    keys, values = _GatherKV.apply(key), _GatherKV.apply(value)
    chunk = query.shape[0] // 2
    order = _chunk_order(size)
    # whole-row order: chunk g sits at all-gather position order.index(g)
    index = torch.cat([torch.arange(order.index(g) * chunk, (order.index(g) + 1) * chunk) for g in range(2 * size)])
    keys, values = keys.index_select(0, index.to(keys.device)), values.index_select(0, index.to(values.device))
    outputs = []
    for half, g in enumerate((rank, 2 * size - 1 - rank)):
        q = query[half * chunk : (half + 1) * chunk]
        end = (g + 1) * chunk
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, keys[:end], values[:end]))  # [B, heads, s, dim]
        outputs.append(_bottom_right_causal(q, k, v, scale, dropout_p))
    out = torch.cat(outputs, dim=2)  # [B, heads, S_local, dim]
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _bottom_right_causal(q, k, v, scale, dropout_p) -> torch.Tensor:
    """Queries that are the last ``q_len`` of ``k_len`` positions: query i sees keys ``<= k_len - q_len + i``."""
    if attention_kernel.uses_shared_kernel(q, v):
        return attention_kernel.causal(q, k, v, scale, dropout_p, bottom_right=True)
    q_len, k_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
