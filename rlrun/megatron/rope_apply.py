"""Megatron's unfused RoPE (no TransformerEngine here) without the work its layers repeat; the same numbers.

megatron-core 0.16.1 ``rope_utils`` rotates each layer's queries and keys in two calls, and for packed (``thd``)
rows each call rebuilds what every call of the forward shares: it reads the sample lengths to the host
(``.tolist()``, a device sync: 56 a forward of a 28-layer model), cuts the frequency rows per sample and
concatenates them, then takes ``cos`` and ``sin``, scales and casts them. And every rotation ends with a copy of
its result (``torch.cat`` with the empty pass-through part, the 84 MB of a 20K-token micro-batch's queries).
Here the per-token frequencies of a ``cu_seqlens`` tensor and the ``cos``/``sin`` of a frequency tensor are kept
for the calls that share them (one entry each, keyed by the tensor objects, which the cache holds), and the copy
is skipped when nothing passes through. Each kept value is what those calls computed, by the same ops, and the
rotation is Megatron's formula, so queries, keys and their gradients are bitwise Megatron's
(tests/integration/test_rope_apply.py); the trainer stays exact with the engine (docs/on_policy.md).

Calls this does not cover go to Megatron's own functions: multi-latent attention (its de-interleave), a rotary
dimension narrower than the head (a real pass-through part), context parallelism on packed rows.
"""

from __future__ import annotations

import torch

_cos_sin_cache: dict[str, tuple] = {}
_positions_cache: dict[str, tuple] = {}


def patch_rope() -> None:
    """Install the two functions in Megatron's ``rope_utils`` (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils._apply_rotary_pos_emb_bshd, "rlrun", False):
        return
    megatron_bshd, megatron_thd = rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_thd

    def rotate_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        if multi_latent_attention or t.shape[-1] != freqs.shape[-1]:
            return megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, sin = _cos_sin(freqs, mscale, t.dtype)
        return (t * cos) + (rope_utils._rotate_half(t, rotary_interleaved) * sin)

    def rotate_thd(
        t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
    ):
        if cp_group is None or cp_group.size() != 1:
            return megatron_thd(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        packed = _packed_freqs(freqs, cu_seqlens, t.shape[0])
        return rotate_bshd(t.unsqueeze(1), packed, rotary_interleaved, multi_latent_attention, mscale).squeeze(1)

    rotate_bshd.rlrun = True  # type: ignore[attr-defined]
    rotate_bshd.megatron = megatron_bshd  # type: ignore[attr-defined]  (the references of the tests)
    rotate_thd.megatron = megatron_thd  # type: ignore[attr-defined]
    rope_utils._apply_rotary_pos_emb_bshd = rotate_bshd
    rope_utils._apply_rotary_pos_emb_thd = rotate_thd


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``(cos(freqs) * mscale).to(dtype)`` and the same for ``sin``, once per frequency tensor."""
    key = (mscale, dtype)
    hit = _cos_sin_cache.get("last")
    if hit is not None and hit[0] is freqs and hit[1] == key:
        return hit[2], hit[3]
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    _cos_sin_cache["last"] = (freqs, key, cos, sin)
    return cos, sin


def _packed_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The frequency row of every packed token, ``[tokens, 1, 1, dim]``, as Megatron's ``thd`` path concatenates
    them with one context-parallel rank: the sample's own positions from 0 (``freqs`` spans the longest sample),
    or, where ``freqs`` has a row per packed token, the token's place in the row. One gather, no host sync."""
    hit = _positions_cache.get("last")
    if hit is not None and hit[0] is freqs and hit[1] is cu_seqlens:
        return hit[2]
    if freqs.shape[0] == tokens:  # Megatron's "exact mapping": freqs[offset + i] for the i-th token of a sample
        packed = freqs
    else:
        starts = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - starts
        offsets = torch.repeat_interleave(starts, lengths, output_size=tokens)
        positions = torch.arange(tokens, device=cu_seqlens.device) - offsets
        packed = freqs.index_select(0, positions.to(freqs.device))
    _positions_cache["last"] = (freqs, cu_seqlens, packed)
    return packed
