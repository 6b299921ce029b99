"""A preallocated KV cache that a transformers model writes through ``cache.update``, plus its masks.

Why not transformers' ``DynamicCache``: it grows by concatenation every step (a new allocation per
layer per token) and its length lives on the host, so a decode step can neither be captured in a
CUDA graph nor run without host bookkeeping. Here every layer owns fixed ``[rows, kv_heads,
max_len, head_dim]`` buffers, and the columns a forward writes are a device tensor
(:attr:`StaticKVCache.columns`) that the decode step advances in place. Attention then reads the first
:attr:`StaticKVCache.read_len` columns (all ``max_len`` unless set: the decode step reads only the filled
part, rounded up to a bucket, see ``decode_batch.read_len``) under a boolean ``[rows, 1, q_len, read_len]``
mask (True = attend), passed to the model as a ready 4-D mask, which transformers' SDPA path uses as is (no
mask building, no host sync).

Attention (:func:`static_cache_attention`, registered with transformers as ``ATTENTION``) runs the kernel
the trainer runs too (:mod:`rlrun.kernels.attention`: on CUDA the memory-efficient kernel, called directly,
not through SDPA's per-call choice), so the engine's log-probs are the trainer's. A one-token decode query
of ``H`` heads over ``H_kv`` cached heads is computed as ``H/H_kv`` queries per KV head, so the kernel
reads each cached head once instead of a copy per query head (``repeat_kv``); on CUDA it reads each row's
own columns by count (``attention_kernel.decode``), not under a mask bias. Prefill attends under its mask.

The object duck-types the part of transformers' ``Cache`` that decoder layers call
(``update(key, value, layer_idx, ...)``; ``get_seq_length``), which is the same in transformers
5.17 and 5.24. Buffers are created on the first ``update`` of each layer (shapes come from the
model), or copied from a prefill cache with :meth:`load_prefix`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlrun.engine.embedded.fused_rope import triton_available
from rlrun.kernels.attention import (
    DecodeRows,
    chunked_kernel_takes,
    decode,
    key_counts,
    mask_bias,
    masked,
    positions_per_row,
    uses_shared_kernel,
)

T = TypeVar("T")

ATTENTION = "rlrun_static_cache"
"""The ``attn_implementation`` name the embedded engine loads its model with."""
ATTENTION_CHUNKED = "rlrun_static_cache_chunked"
"""The same with the chunked kernels (:func:`chunked_static_cache_attention`), for a trainer on them."""


class StaticKVCache:
    """Fixed-size per-layer K/V buffers; a forward writes its new K/V at :attr:`columns`."""

    def __init__(self, num_rows: int, max_len: int, device: torch.device, per_row: bool = False) -> None:
        self.num_rows = num_rows
        self.max_len = max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.per_row = per_row
        self.columns = torch.zeros(num_rows if per_row else 1, dtype=torch.long, device=device)
        """Cache columns the next forward writes (set or advanced in place): one per query position, shared
        by all rows; or, ``per_row`` (decode, one query position), one per row."""
        self._write_kv: Callable[..., None] | None = None
        """A decode step writes its K/V in one Triton launch (``triton_kernels.write_kv_columns``), not two scatters."""
        if per_row and device.type == "cuda" and triton_available():
            from rlrun.engine.embedded.triton_kernels import write_kv_columns

            self._write_kv = write_kv_columns
        self.read_len: int | None = None
        """Columns ``update`` hands to attention (a host int, fixed per captured step; None: all). Every column a
        row attends to must lie below it; the columns beyond are masked anyway, so leaving them out changes
        no attended score (see docs/engine.md for what that does to the kernel's sums)."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this layer's new K/V ([rows, heads, q_len, dim]) and return the buffers' first ``read_len``
        columns (views: a captured step reads the same memory)."""
        if layer_idx == len(self.keys):  # first forward: allocate from the model's own shapes
            self._allocate(key, value)
        if self._write_kv is not None and key.stride(-1) == value.stride(-1) == 1:
            self._write_kv(self.keys[layer_idx], self.values[layer_idx], key, value, self.columns)
        elif self.per_row:
            index = self.columns.view(-1, 1, 1, 1).expand(-1, key.shape[1], 1, key.shape[-1])
            self.keys[layer_idx].scatter_(2, index, key)
            index = self.columns.view(-1, 1, 1, 1).expand(-1, value.shape[1], 1, value.shape[-1])
            self.values[layer_idx].scatter_(2, index, value)
        else:
            self.keys[layer_idx].index_copy_(2, self.columns, key)
            self.values[layer_idx].index_copy_(2, self.columns, value)
        end = self.max_len if self.read_len is None else self.read_len
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    @property
    def reads_by_count(self) -> bool:
        """Whether a decode step over this (loaded) cache attends by key counts (:func:`static_cache_attention`'s
        CUDA path: the shared kernel takes its heads), which reads each row's own columns whatever ``read_len``:
        then one captured step serves every fill level (``DecodeRun.forward``)."""
        return bool(self.keys) and count_layout(self.keys[0], self.values[0]) is not None

    def _allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The next layer's buffers, each shaped after its own tensor: multi-latent attention (DeepSeek-V3) caches
        its kv latent as "keys" and its RoPE key as "values", of different widths."""
        for buffers, t in ((self.keys, key), (self.values, value)):
            shape = (self.num_rows, t.shape[1], self.max_len, t.shape[-1])
            buffers.append(torch.zeros(shape, dtype=t.dtype, device=t.device))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Capacity, not fill: callers always pass explicit position ids (transformers only asks for
        this when they are missing)."""
        return self.max_len

    def head(self, rows: int) -> StaticKVCache:
        """The first ``rows`` rows as a cache of their own: views of these buffers (allocated already), and of
        the per-row columns, so a decode step over it writes these rows."""
        assert self.per_row and self.keys, "a head is taken of a decode cache whose rows were loaded"
        head = StaticKVCache(rows, self.max_len, self.columns.device, per_row=True)
        head.keys = [k[:rows] for k in self.keys]
        head.values = [v[:rows] for v in self.values]
        head.columns = self.columns[:rows]
        return head

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, width: int) -> None:
        """Rows ``src`` into rows ``dst`` (disjoint): the first ``width`` columns of their K/V (the ones any row
        attends to before writing again) and their write columns."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[dst, :, :width] = buffer[src, :, :width]
        self.columns[dst] = self.columns[src]

    def load_prefix(self, prefill: StaticKVCache, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy ``prefill``'s columns into the first columns of rows ``slots`` (slot ``slots[k]`` takes prefill
        row ``rows[k]``: the samples of one prompt share its prefill), allocating buffers if needed."""
        width = prefill.max_len
        for layer, (key, value) in enumerate(zip(prefill.keys, prefill.values, strict=False)):
            if layer == len(self.keys):
                self._allocate(key, value)
            self.keys[layer][slots, :, :width] = key[rows]
            self.values[layer][slots, :, :width] = value[rows]


def prefill_mask(prompt_mask: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """[P, 1, stop - start, stop] boolean mask of the padded prompts' positions ``start`` to ``stop - 1`` (a prefill
    chunk; all ``W`` by default) over columns 0 to ``stop - 1``: causal over real tokens. A padding query attends to
    itself only, so no row is fully masked (the kernel would return NaN there, and the NaN would reach the padding's
    cached K/V)."""
    stop = prompt_mask.shape[-1] if stop is None else stop
    rows = torch.arange(start, stop, device=prompt_mask.device)[:, None]
    columns = torch.arange(stop, device=prompt_mask.device)[None, :]
    mask = (columns <= rows) & prompt_mask.bool()[:, None, :stop]
    mask |= columns == rows
    return mask[:, None]


def count_layout(key: torch.Tensor, value: torch.Tensor) -> int | None:
    """Where a one-position query over these cache views attends by key counts (``attention_kernel.decode``: the
    shared kernel takes the heads, a query being as wide as its keys, and both views pack without a copy), their
    positions per row; else None. The one decision :func:`static_cache_attention` and
    :attr:`StaticKVCache.reads_by_count` share."""
    per_row = positions_per_row(key)
    if not uses_shared_kernel(key, value) or per_row is None or per_row != positions_per_row(value):
        return None
    return per_row


def static_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ([B, q_len, H, D_v], None).

    One query position: the ``G = H / H_kv`` query heads that share a KV head (heads ``kv * G + g``,
    transformers' ``repeat_kv`` order) become a length-G query over that head: on CUDA each row reads its own
    columns (the count of its [B, 1, 1, L] mask, a prefix: :class:`DecodeRows`), elsewhere under the mask.
    Longer queries (prefill) attend under their [B, 1, q_len, L] mask. Without a boolean mask (never from this
    engine) transformers' SDPA path runs.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if attention_mask is None or attention_mask.dtype != torch.bool or heads % kv_heads:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    per_row = count_layout(key, value) if q_len == 1 else None
    if per_row is not None:
        groups = heads // kv_heads
        rows = _per_forward(("decode", groups, per_row), attention_mask, DecodeRows.of, groups, per_row)
        return decode(query, key, value, rows, scale=scaling), None
    shared = uses_shared_kernel(query, value)
    bias = _per_forward(("bias", query.dtype), attention_mask, mask_bias, query.dtype) if shared else None
    if q_len != 1:
        return masked(query, key, value, attention_mask, scale=scaling, bias=bias).transpose(1, 2), None
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = masked(grouped, key, value, attention_mask, scale=scaling, bias=bias)
    return out.reshape(batch, 1, heads, value.shape[-1]), None  # MLA's value heads are narrower than its queries


def chunked_static_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """:func:`static_cache_attention` on the chunked kernels (:mod:`rlrun.kernels.chunked_attention`), for an engine
    whose
    trainer runs ``model.packed_attention: chunked_varlen``. A decode step reads each row's first count columns (its
    mask's, a prefix) split over thread blocks; a prefill (chunk) of right-padded prompts attends causally from column
    0, so a prompt's positions see exactly its own tokens before them (a padding position sees the padding before it
    too: finite, and never read, since decoding overwrites those columns first). Heads the kernels do not take go
    to :func:`static_cache_attention`, as the trainer's go to the memory-efficient kernel."""
    batch, heads, q_len, dim = query.shape
    if (
        attention_mask is None
        or attention_mask.dtype != torch.bool
        or heads % key.shape[1]
        or not chunked_kernel_takes(query, value, heads // key.shape[1])
    ):
        return static_cache_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    from rlrun.kernels import chunked_attention

    scale = dim**-0.5 if scaling is None else scaling
    if q_len == 1:
        counts = _per_forward(("counts",), attention_mask, key_counts)
        return chunked_attention.decode(query[:, :, 0], key, value, counts, scale)[:, None], None
    layout = _per_forward(("prefill", batch, q_len), attention_mask, _prefill_layout, batch, q_len)
    out = query.new_empty(batch, q_len, heads, value.shape[-1])
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return chunked_attention.causal(q, k, v, out, layout, q_len, scale), None


def _prefill_layout(
    mask: torch.Tensor, rows: int, q_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunked_attention.causal`'s layout of a prefill (chunk) under ``mask`` ([rows, 1, q_len, stop]): each row
    a sample from its first query and key, its ``q_len`` queries at positions ``stop - q_len`` on."""
    zeros = torch.zeros(rows, dtype=torch.int32, device=mask.device)
    return zeros, zeros, zeros + q_len, zeros + (mask.shape[-1] - q_len)


_forward_state = threading.local()
"""``built``: {kind: (mask, what was built from it)} of the forward in progress on this thread, inside
:func:`built_per_forward`."""


@contextlib.contextmanager
def built_per_forward() -> Iterator[None]:
    """Within: every layer of the forward attends under the one mask object the model was given, so what is
    built from it (a prefill's additive bias, a decode step's :class:`DecodeRows`) is built once, at the first
    layer, not once per layer (a few kernels a layer of a decode step, a few microseconds each). On exit it is let
    go with the mask (a captured step's tensors live in its graph's memory pool, which must not be held once the
    engine releases its memory)."""
    _forward_state.built = {}
    _forward_state.active = True
    try:
        yield
    finally:
        _forward_state.built = {}
        _forward_state.active = False


def _per_forward(kind: tuple, mask: torch.Tensor, build: Callable[..., T], *args) -> T:
    """``build(mask, *args)``: inside :func:`built_per_forward` built at the first layer for this mask and
    ``kind``, reused by the others; outside it, built each call."""
    if not getattr(_forward_state, "active", False):
        return build(mask, *args)
    last = _forward_state.built.get(kind)
    if last is None or last[0] is not mask:
        last = _forward_state.built[kind] = (mask, build(mask, *args))
    return last[1]


AttentionInterface.register(ATTENTION, static_cache_attention)
AttentionInterface.register(ATTENTION_CHUNKED, chunked_static_cache_attention)
