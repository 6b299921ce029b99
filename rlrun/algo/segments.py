"""Per-sample reductions over ``[B, T]`` tensors whose rows may hold several packed samples.

``sample_ids [B, T]`` names the sample each position belongs to (``MicroBatch.sample_ids``: numbered
0, 1, ... across the rows, -1 for positions of no sample). ``None`` means one sample per row, the
unpacked layout, so callers without packing pass nothing. Sequence-level quantities (GSPO's ratio,
per-sample loss weights, TIS sequence weights, returns that must not flow from one sample into the
previous one) are computed per sample through these functions, never per row.
"""

from __future__ import annotations

import torch

from rlrun.runtime.host_to_device import to_device


def resolve(sample_ids: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``sample_ids`` on ``like``'s device, or the one-sample-per-row ids when it is None."""
    if sample_ids is None:
        rows = torch.arange(like.shape[0], device=like.device).unsqueeze(-1)
        return rows.expand(like.shape)
    if sample_ids.shape != like.shape:
        raise ValueError(
            f"sample_ids shape ({tuple(sample_ids.shape)}) must equal the per-token tensors' "
            f"({tuple(like.shape)}) because each position needs its sample"
        )
    return to_device(sample_ids, like.device)


def _bins(sample_ids: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ids, bins, count)``: the ids on ``like``'s device, ``ids + 1`` flattened (bin 0 collects the positions
    of no sample) and the number of bins, counted where the ids are: host ids (``MicroBatch.sample_ids``) cost the
    device no sync in the middle of the loss."""
    count = like.shape[0] + 1 if sample_ids is None else int(sample_ids.max()) + 2
    ids = resolve(sample_ids, like)
    return ids, (ids + 1).reshape(-1), count


def sample_sum(x: torch.Tensor, sample_ids: torch.Tensor | None) -> torch.Tensor:
    """Each position's sample total ``sum_{t' in sample(t)} x_t'`` (0 at positions of no sample);
    differentiable in ``x``."""
    ids, bins, count = _bins(sample_ids, x)
    totals = torch.zeros(count, dtype=x.dtype, device=x.device).index_add(0, bins, x.reshape(-1))
    return torch.where(ids >= 0, totals[bins].reshape(x.shape), torch.zeros_like(x))


def sample_max(x: torch.Tensor, sample_ids: torch.Tensor | None) -> torch.Tensor:
    """Each position's sample maximum of ``x`` (no gradient; positions of no sample keep their own value)."""
    ids, bins, count = _bins(sample_ids, x)
    empty = torch.zeros(count, dtype=x.dtype, device=x.device)
    maxima = empty.scatter_reduce(0, bins, x.reshape(-1), reduce="amax", include_self=False)
    return torch.where(ids >= 0, maxima[bins].reshape(x.shape), x)


def continues(sample_ids: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: position ``t + 1`` belongs to the same sample as ``t`` (False at each sample's
    last position and at the row end): where a backward recursion over time must not carry on."""
    ids = resolve(sample_ids, like)
    same = (ids[..., 1:] == ids[..., :-1]) & (ids[..., :-1] >= 0)
    return torch.cat([same, torch.zeros_like(same[..., :1])], dim=-1)
