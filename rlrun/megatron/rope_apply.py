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

import weakref

import torch

from rlrun.kernels.triton_support import triton_available
from rlrun.runtime.host_to_device import to_device

_cos_sin_cache: dict[str, tuple] = {}
_positions_cache: dict[str, tuple] = {}
_halves_cache: dict[int, tuple[weakref.ref, bool]] = {}
HALVES_CHECKED = 32
"""Frequency tables whose halves' check is kept, as many as Megatron's ``RotaryEmbedding.forward`` caches."""


def patch_rope() -> None:
    """Install the two functions in Megatron's ``rope_utils`` (idempotent)."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils._apply_rotary_pos_emb_bshd, "rlrun", False):
        return
    megatron_bshd, megatron_thd = rope_utils._apply_rotary_pos_emb_bshd, rope_utils._apply_rotary_pos_emb_thd

    def rotate_bshd(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, *, table=None):
        """``table``: the frequency table ``freqs``'s rows were gathered from (``rotate_thd``), whose halves' check
        holds for them and is kept per table; Megatron's own calls pass ``freqs`` itself."""
        if multi_latent_attention or t.shape[-1] != freqs.shape[-1]:
            return megatron_bshd(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        halves_equal = _halves_equal(freqs if table is None else table)
        cos, sin, neg_sin = _cos_sin(freqs, mscale, t.dtype, halves_equal)
        if neg_sin is not None and not rotary_interleaved and _kernel_covers(t, cos):
            return _Rotate.apply(t, cos, sin, neg_sin)
        return (t * cos) + (rope_utils._rotate_half(t, rotary_interleaved) * sin)

    def rotate_thd(
        t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0, cp_group=None
    ):
        if cp_group is None or cp_group.size() != 1:
            return megatron_thd(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        packed = _packed_freqs(freqs, cu_seqlens, t.shape[0])
        rotated = rotate_bshd(t.unsqueeze(1), packed, rotary_interleaved, multi_latent_attention, mscale, table=freqs)
        return rotated.squeeze(1)

    rotate_bshd.rlrun = True  # type: ignore[attr-defined]
    rotate_bshd.megatron = megatron_bshd  # type: ignore[attr-defined]  (the references of the tests)
    rotate_thd.megatron = megatron_thd  # type: ignore[attr-defined]
    rope_utils._apply_rotary_pos_emb_bshd = rotate_bshd
    rope_utils._apply_rotary_pos_emb_thd = rotate_thd


def _halves_equal(freqs: torch.Tensor) -> bool:
    """Whether, on CUDA, the two halves of ``freqs``'s last dimension are equal (Megatron's non-interleaved
    ``cat((f, f))``, which the kernel's backward relies on). A host sync, so once per frequency table: Megatron's
    ``RotaryEmbedding.forward`` keeps its tables (``lru_cache``, one per longest-sample length, at most
    ``HALVES_CHECKED`` of them), and a packed micro-batch's rows are gathered from one (:func:`_packed_freqs`), so
    micro-batches of different longest samples do not repeat the check at each one's first layer."""
    hit = _halves_cache.get(id(freqs))
    if hit is not None and hit[0]() is freqs:
        return hit[1]
    half = freqs.shape[-1] // 2
    equal = freqs.is_cuda and torch.equal(freqs[..., :half], freqs[..., half : 2 * half])
    if len(_halves_cache) >= HALVES_CHECKED:
        _halves_cache.pop(next(iter(_halves_cache)))  # the oldest
    _halves_cache[id(freqs)] = (weakref.ref(freqs), equal)  # not kept alive: a dead table's id may be reused
    return equal


def _cos_sin(
    freqs: torch.Tensor, mscale: float, dtype: torch.dtype, halves_equal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Megatron's ``(cos(freqs) * mscale).to(dtype)`` and the same for ``sin``, once per frequency tensor; and,
    where ``halves_equal`` (:func:`_halves_equal`), ``-sin`` for the kernel's backward, else None."""
    key = (mscale, dtype, halves_equal)
    hit = _cos_sin_cache.get("last")
    if hit is not None and hit[0] is freqs and hit[1] == key:
        return hit[2]
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    trig = (cos, sin, -sin if halves_equal else None)
    _cos_sin_cache["last"] = (freqs, key, trig)
    return trig


def _kernel_covers(t: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the Triton rotation (rlrun/kernels/rope.py) takes ``t [S, B, H, D]`` under ``cos [S, 1, 1, D]``:
    CUDA with Triton installed, even D, unit stride along D, one dtype."""
    return (
        t.is_cuda
        and t.dim() == 4
        and cos.shape == (t.shape[0], 1, 1, t.shape[-1])
        and t.shape[-1] % 2 == 0
        and t.stride(-1) == 1
        and cos.dtype == t.dtype
        and triton_available()
    )


def _rotate_with_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` of ``x [S, B, H, D]`` by the shared kernel, which reads ``[B, H, S, D]``
    views and ``[B, S, D]`` cos/sin (broadcast over the batch: stride 0)."""
    from rlrun.kernels.rope import rope_qk

    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    seq, batch, _, dim = x.shape
    as_bhsd = lambda y: y.permute(1, 2, 0, 3)  # noqa: E731
    cos_bsd = cos.view(seq, 1, dim).permute(1, 0, 2).expand(batch, seq, dim)
    sin_bsd = sin.view(seq, 1, dim).permute(1, 0, 2).expand(batch, seq, dim)
    none = as_bhsd(x)[:, :0]  # no key rows: one tensor a call, as Megatron rotates them
    rope_qk(as_bhsd(x), none, cos_bsd, sin_bsd, as_bhsd(out), none)
    return out


class _Rotate(torch.autograd.Function):
    """Megatron's rotation by the kernel, forward and backward. The gradient of ``x * cos + rotate_half(x) * sin``
    is ``g * cos + rotate_half^T(g * sin)``, and ``rotate_half^T(v) = cat(v2, -v1)``; with equal halves of
    ``sin`` that is the rotation of ``g`` under ``-sin``, rounded where autograd's eager backward rounds (each
    product, then their sum), so the gradient is eager Megatron's bit for bit too."""

    @staticmethod
    def forward(ctx, x, cos, sin, neg_sin):
        ctx.save_for_backward(cos, neg_sin)
        return _rotate_with_kernel(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, neg_sin = ctx.saved_tensors
        return _rotate_with_kernel(grad, cos, neg_sin), None, None, None


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
        packed = freqs.index_select(0, to_device(positions, freqs.device))
    _positions_cache["last"] = (freqs, cu_seqlens, packed)
    return packed
