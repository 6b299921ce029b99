"""The one attention kernel the trainer and the embedded engine share on CUDA, so that their log-probs agree.

Why: torch SDPA picks its kernel per call (cuDNN, FlashAttention-2, memory-efficient, math) from the inputs,
the GPU and the torch version. The engine attends under a boolean mask (left-padded prefill, a KV cache
read under a column mask), so it never gets FlashAttention; the trainer attends causally without a mask.
When the two sides run different kernels, each attention output can round differently in bf16, and 30
layers amplify that to the whole bf16-vs-fp32 difference of a model (BENCHMARKS.md, "Exactness": the trainer
on FlashAttention's varlen kernel).

So on CUDA both sides call the memory-efficient (xformers/cutlass) kernel directly, never through SDPA's
choice: the trainer as one varlen call per layer over a packed row (``cu_seqlens``, causal), the engine
with its mask as an additive bias. One query row's result in that kernel depends only on its own
scores and on how its keys fall into the kernel's key blocks, which start at the sample's first key on
both sides when the prompt is not left-padded. Then the two forwards are bitwise equal, whatever the
number of queries per call (decode's one token, the trainer's whole sequence) and whatever other
samples share the call. A left-padded prompt (shorter than the longest in its engine batch) shifts its
keys against those blocks: still the same kernel, but its sums are split differently, so rare bf16
roundings differ (BENCHMARKS.md, "Exactness").

The kernel also runs in float32 (FlashAttention does not), so fp32 CUDA runs pack too. On CPU everything
stays on ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from rlrun.kernels.triton_support import triton_available

CAUSAL_FROM_TOP_LEFT = 1
"""``custom_mask_type`` of ``aten._efficient_attention_forward``: query i sees keys 0..i of its sample."""
CAUSAL_FROM_BOTTOM_RIGHT = 2
"""The same with the diagonal at the bottom right: ``q_len`` queries that are the last of ``k_len`` positions
(context parallelism, rlrun/megatron/context_parallel.py)."""
BIAS_ALIGN = 16
"""The kernel reads the bias in rows aligned to this many elements (what SDPA's own ``pad_bias`` does)."""


KERNEL_ALIGN_BYTES = 16
"""The kernel's head widths (query/key and value) must be whole multiples of 16 bytes on the GPUs it is built for
(sm80 and newer: 8 bf16/fp16 or 4 fp32 elements); for others it has no kernel ("cutlassF: no kernel found to
launch"). SDPA checks the same (its ``minimum_gemm_alignment``) and picks another kernel."""


def kernel_has_head_dims(dtype: torch.dtype, *widths: int) -> bool:
    """True when the kernel takes heads of these widths in ``dtype``: real models' 64, 128, 192, ... always;
    tiny test models (DeepSeek-V3's 20-wide queries, 10-wide values) not always."""
    align = KERNEL_ALIGN_BYTES // dtype.itemsize
    return all(width % align == 0 for width in widths)


def uses_shared_kernel(query: torch.Tensor, value: torch.Tensor) -> bool:
    """True where the shared kernel runs: CUDA, heads it has a kernel for. Elsewhere callers use plain SDPA.
    The answer reads only the tensors' device, dtype and widths, so the trainer and the engine fall back alike."""
    return query.is_cuda and kernel_has_head_dims(query.dtype, query.shape[-1], value.shape[-1])


CHUNKED_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head widths the chunked kernels (:mod:`rlrun.kernels.chunked_attention`) take: a power of two, a tile's columns."""
CHUNKED_MAX_GROUPS = 64
"""Query heads a cached head at most for the chunked kernels: a decode tile holds them (``chunked_attention.BLOCK_M``
rows, the forward's height, which the decode must share to round alike)."""


def auto_packed_attention(dtype: str) -> str:
    """``model.packed_attention: auto``'s kernel for a trainer in ``dtype``: ``chunked_varlen`` on CUDA with Triton in
    bfloat16 (the trainer and the embedded engine on the chunked kernels: bitwise, the engine's decode split over thread
    blocks, the forward faster than the memory-efficient one; BENCHMARKS.md "Decode attention: fast and exact"),
    ``efficient_varlen`` elsewhere on CUDA, ``per_sample`` off CUDA."""
    if not torch.cuda.is_available():
        return "per_sample"
    return "chunked_varlen" if dtype == "bfloat16" and triton_available() else "efficient_varlen"


def engine_kernel_family(packed_attention: str, dtype: str, context_parallel: int = 1) -> str:
    """The embedded engine's attention kernels for a trainer on ``model.packed_attention`` (``BackendSpec.attention_
    kernel``): ``chunked`` where the trainer's rows run the chunked kernels (``chunked_varlen``, or ``auto`` resolving
    to it, without context parallelism, whose chunks run the memory-efficient kernel), else ``efficient``."""
    kernel = auto_packed_attention(dtype) if packed_attention == "auto" else packed_attention
    return "chunked" if kernel == "chunked_varlen" and context_parallel == 1 else "efficient"


def chunked_kernel_takes(query: torch.Tensor, value: torch.Tensor, groups: int) -> bool:
    """Whether the chunked kernels run for these heads (``groups`` query heads a cached head): CUDA with Triton, bf16 or
    fp16 (fp32 would multiply in TF32 there), values as wide as queries, a width in :data:`CHUNKED_HEAD_DIMS`, at most
    :data:`CHUNKED_MAX_GROUPS` groups. Reads only device, dtype, widths and head counts, so the trainer and the engine
    decide alike; where False both run the memory-efficient kernel."""
    return (
        0 < groups <= CHUNKED_MAX_GROUPS
        and query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and value.dtype == query.dtype
        and query.shape[-1] == value.shape[-1]
        and query.shape[-1] in CHUNKED_HEAD_DIMS
        and triton_available()
    )


def _scale(query: torch.Tensor, scale: float | None) -> float:
    """The softmax scale as transformers computes it (``head_dim ** -0.5``), passed explicitly on both sides
    so that no side derives it in another precision."""
    return query.shape[-1] ** -0.5 if scale is None else scale


def _repeat_heads(kv: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Grouped-query K/V with ``heads`` query heads: KV head j serves query heads j*G .. j*G+G-1 (transformers'
    ``repeat_kv`` and Megatron's order). The kernel has no grouped heads, so they are copied."""
    groups = heads // kv.shape[dim]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=dim)


def causal_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each sample of a packed row: ``[T, heads, dim]`` in and out, samples
    bounded by ``cu_seqlens`` (int32, on the device). Differentiable: by FlashAttention-2's backward where it takes
    the shapes (:class:`_FlashBackward`), else by torch's efficient-attention backward."""
    if not kernel_has_head_dims(query.dtype, query.shape[-1], value.shape[-1]):
        raise ValueError(
            f"model.packed_attention efficient_varlen: the memory-efficient kernel has no {query.dtype} kernel for "
            f"heads {query.shape[-1]} (query) and {value.shape[-1]} (value) wide (it needs multiples of "
            f"{KERNEL_ALIGN_BYTES} bytes); use model.packed_attention: per_sample"
        )
    if dropout_p == 0.0 and torch.is_grad_enabled() and flash_backward_covers(query, key, value):
        return _FlashBackward.apply(query, key, value, cu_seqlens, max_len, _scale(query, scale))
    logsumexp = torch.is_grad_enabled() and query.requires_grad  # what torch's backward of the kernel reads
    return efficient_varlen(query, key, value, cu_seqlens, max_len, _scale(query, scale), dropout_p, logsumexp)[0]


def efficient_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float,
    dropout_p: float = 0.0,
    logsumexp: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory-efficient kernel over a packed row, grouped key/value heads repeated for it: the output
    ``[T, heads, dim]`` and (with ``logsumexp``) its log-sum-exp ``[samples, heads, max_len rounded up to 32]``."""
    key, value = (_repeat_heads(t, query.shape[1], 1) for t in (key, value))
    out, lse = torch.ops.aten._efficient_attention_forward(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        None,
        cu_seqlens,
        cu_seqlens,
        max_len,
        max_len,
        dropout_p,
        CAUSAL_FROM_TOP_LEFT,
        logsumexp,
        scale=scale,
    )[:2]
    return out.squeeze(0), lse


FLASH_HEAD_DIMS = range(8, 257, 8)
"""Head widths FlashAttention-2's backward takes (torch's build: up to 256, multiples of 8)."""


def flash_backward_covers(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :class:`_FlashBackward` takes these ``[T, heads, dim]`` tensors: CUDA (sm80 or newer), bf16 or fp16,
    one width for queries, keys and values that FlashAttention-2 has, whole groups of query heads, something to
    differentiate."""
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and key.dtype == value.dtype == query.dtype
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and query.shape[-1] in FLASH_HEAD_DIMS
        and query.shape[1] % key.shape[1] == 0
        and any(t.requires_grad for t in (query, key, value))
        and torch.cuda.get_device_capability(query.device)[0] >= 8
    )


def _flash_logsumexp(logsumexp: torch.Tensor, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """The memory-efficient kernel's log-sum-exp of a packed row (``[samples, heads, max_len rounded up to 32]``, each
    sample's rows from 0) in FlashAttention-2's varlen layout (``[heads, tokens]``): one gather."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=starts.device), lengths, output_size=tokens)
    position = torch.arange(tokens, device=starts.device) - starts[sample]
    return logsumexp[sample, :, position].t().contiguous()


class _FlashBackward(torch.autograd.Function):
    """The memory-efficient kernel forward, FlashAttention-2's varlen backward.

    Why: the forward must be the engine's kernel (the module docstring), the backward need not: no log-prob comes out of
    it. FlashAttention-2's backward runs about twice the memory-efficient one's rate at short samples (BENCHMARKS.md,
    "The attention kernel at long context"), takes grouped key/value heads as they are (the repeated copies, and the sum
    of their gradients, are only the forward's), and needs only what the forward keeps anyway: its output and
    log-sum-exp (the same natural log-sum-exp of the scaled scores; rearranged by :func:`_flash_logsumexp`). The
    gradients are those of the attention this forward computed, to bf16 rounding (tests/gpu/test_attention_gpu.py)."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, max_len, scale):
        out, logsumexp = efficient_varlen(query, key, value, cu_seqlens, max_len, scale, logsumexp=True)
        ctx.save_for_backward(query, key, value, out, logsumexp, cu_seqlens)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, logsumexp, cu_seqlens = ctx.saved_tensors
        logsumexp = _flash_logsumexp(logsumexp, cu_seqlens, query.shape[0])
        return *_flash_varlen_backward(ctx, grad_out, query, key, value, out, logsumexp, cu_seqlens), None, None, None


def _flash_varlen_backward(ctx, grad_out, query, key, value, out, logsumexp, cu_seqlens):
    """FlashAttention-2's varlen backward of a causal forward's ``out`` and log-sum-exp (``[heads, T]``): the
    gradients of query, key and value (``ctx.max_len``, ``ctx.scale``: the forward's)."""
    unused = torch.empty((), dtype=torch.int64, device=query.device)  # dropout's random state: no dropout here
    return torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(),
        query,
        key,
        value,
        out,
        logsumexp,
        cu_seqlens,
        cu_seqlens,
        ctx.max_len,
        ctx.max_len,
        0.0,
        True,
        unused,
        unused,
        scale=ctx.scale,
    )[:3]


class _ChunkedForward(torch.autograd.Function):
    """The chunked forward (:mod:`rlrun.kernels.chunked_attention`, the embedded engine's kernel when the trainer runs
    ``model.packed_attention: chunked_varlen``), FlashAttention-2's varlen backward fed its log-sum-exp, as
    :class:`_FlashBackward` is fed the memory-efficient kernel's."""

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens, max_len, scale):
        from rlrun.kernels import chunked_attention

        out, logsumexp = chunked_attention.causal_varlen(query, key, value, cu_seqlens, max_len, scale, True)
        ctx.save_for_backward(query, key, value, out, logsumexp, cu_seqlens)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, logsumexp, cu_seqlens = ctx.saved_tensors
        return *_flash_varlen_backward(ctx, grad_out, query, key, value, out, logsumexp, cu_seqlens), None, None, None


def chunked_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """:func:`causal_varlen` on the chunked kernels (``model.packed_attention: chunked_varlen``) for heads
    :func:`chunked_kernel_takes`, no dropout (RL post-training runs none); other heads run :func:`causal_varlen`, as
    the engine's do."""
    if not chunked_kernel_takes(query, value, query.shape[1] // key.shape[1]):
        return causal_varlen(query, key, value, cu_seqlens, max_len, scale, dropout_p)
    if dropout_p != 0.0:
        raise ValueError(
            f"model.packed_attention chunked_varlen has no attention dropout (got {dropout_p}) because its kernel "
            "has none; set the model's attention dropout to 0 or use efficient_varlen"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return _ChunkedForward.apply(query, key, value, cu_seqlens, max_len, _scale(query, scale))
    from rlrun.kernels import chunked_attention

    return chunked_attention.causal_varlen(query, key, value, cu_seqlens, max_len, _scale(query, scale))[0]


def causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    dropout_p: float = 0.0,
    bottom_right: bool = False,
) -> torch.Tensor:
    """Causal attention over ``[B, heads, S, dim]`` (key/value may have fewer, grouped heads); ``bottom_right``
    (CUDA only): fewer queries than keys, the queries being the last positions."""
    if not uses_shared_kernel(query, value):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=key.shape[1] != query.shape[1],
        )
    key, value = (_repeat_heads(t, query.shape[1], 1) for t in (key, value))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # the kernel's [B, S, heads, dim]
    out = torch.ops.aten._efficient_attention_forward(
        q,
        k,
        v,
        None,
        None,
        None,
        None,
        None,
        dropout_p,
        CAUSAL_FROM_BOTTOM_RIGHT if bottom_right else CAUSAL_FROM_TOP_LEFT,
        torch.is_grad_enabled() and query.requires_grad,
        scale=_scale(query, scale),
    )[0]
    return out.transpose(1, 2)


def mask_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's conversion of a boolean mask (True = attend) to an additive bias in ``dtype`` (0 where attended,
    -inf elsewhere), padded so that each bias row starts aligned; the kernel adds 0.0 exactly, so attended
    scores are unchanged. Returns the unpadded view, shaped like ``mask``."""
    k_len = mask.shape[-1]
    padded = -(-k_len // BIAS_ALIGN) * BIAS_ALIGN
    bias = torch.full((*mask.shape[:-1], padded), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :k_len].masked_fill_(mask, 0.0)
    return bias[..., :k_len]


def masked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inference attention over ``[B, heads, q_len, dim]`` under a boolean mask broadcastable to
    ``[B, heads, q_len, k_len]`` (True = attend); key/value may have fewer, grouped heads. No autograd.
    ``bias``: ``mask_bias(mask, query.dtype)`` when the caller already has it (every layer of one forward
    attends under the same mask)."""
    if not uses_shared_kernel(query, value):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
        )
    key, value = (_repeat_heads(t, query.shape[1], 1) for t in (key, value))
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    bias = (mask_bias(mask, query.dtype) if bias is None else bias).expand(batch, heads, q_len, k_len)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, 0.0, 0, False, scale=_scale(query, scale)
    )[0]
    return out.transpose(1, 2)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """Where a decode step's queries and keys lie in the packed layout :func:`decode` gives the kernel: one decode
    forward's, built at its first layer and shared by all (:mod:`rlrun.engine.embedded.static_cache`)."""

    key_counts: torch.Tensor
    """[B] int32: the cache columns row b attends to, its first ``key_counts[b]``."""
    query_starts: torch.Tensor
    """[B + 1] int32: row b's G query rows start at ``b * G``."""
    key_starts: torch.Tensor
    """[B + 1] int32: row b's keys start at packed position ``b * positions_per_row``."""

    @classmethod
    def of(cls, mask: torch.Tensor, groups: int, positions_per_row: int) -> DecodeRows:
        """From a decode step's boolean mask (``[B, 1, 1, L]``, True = attend). Each mask row must be a prefix of
        the cache columns (the embedded engine's are: a prompt's columns, then each column a decode step wrote);
        a row's count is its number of True columns."""
        steps = torch.arange(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
        return cls(
            key_counts=key_counts(mask),
            query_starts=steps * groups,
            key_starts=steps * positions_per_row,
        )


def key_counts(mask: torch.Tensor) -> torch.Tensor:
    """[B] int32: the True columns of each row of a decode step's ``[B, 1, 1, L]`` mask (a prefix: its key count)."""
    return mask.reshape(mask.shape[0], -1).sum(-1, dtype=torch.int32)


def positions_per_row(cache: torch.Tensor) -> int | None:
    """For a cache view ``[B, H_kv, L, D]`` whose positions are contiguous within each head (a slice of fixed
    ``[B, H_kv, max_len, D]`` buffers, rows and read length alike), the distance between two rows in positions;
    None for any other layout (:func:`decode` cannot pack it without a copy)."""
    row, _, position, last = cache.stride()
    if last != 1 or position != cache.shape[-1] or row % position:
        return None
    return row // position


def _packed_positions(cache: torch.Tensor, per_row: int) -> torch.Tensor:
    """The cache view as the kernel's packed ``[1, T, H_kv, D]``, without a copy: packed position ``b * per_row + p``
    is row b's column p (the rows' other heads and unused columns lie between; the kernel reads row b from
    ``key_starts[b]`` for ``key_counts[b]`` positions only)."""
    batch, heads, length, dim = cache.shape
    _, head, position, _ = cache.stride()
    packed = (batch - 1) * per_row + length
    return cache.as_strided((1, packed, heads, dim), (packed * position, position, head, 1))


def _packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_starts: torch.Tensor,
    key_starts: torch.Tensor,
    max_queries: int,
    max_keys: int,
    scale: float,
    key_counts: torch.Tensor,
) -> torch.Tensor:
    """The memory-efficient kernel over packed sequences (``[1, T, heads, dim]``, no mask): sequence b's queries from
    ``query_starts[b]`` to ``query_starts[b + 1]`` attend to the ``key_counts[b]`` keys from ``key_starts[b]``."""
    return torch.ops.aten._efficient_attention_forward(
        query,
        key,
        value,
        None,
        query_starts,
        key_starts,
        max_queries,
        max_keys,
        0.0,
        0,
        False,
        scale=scale,
        seqlen_k=key_counts,
    )[0]


def decode(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: DecodeRows, scale: float | None = None
) -> torch.Tensor:
    """A decode step's attention: one position's queries ``[B, H, 1, D]`` over a KV cache's columns ``key`` ``[B, H_kv,
    L, D]`` and ``value`` ``[B, H_kv, L, D_v]`` (layouts :func:`positions_per_row` takes), row b reading its first
    ``rows.key_counts[b]`` columns; returns ``[B, 1, H, D_v]``.

    The G = H / H_kv query heads of a cached head go in as G query rows over it (each cached head read once), and the
    cache as packed sequences whose key counts are a device tensor, so no mask bias is read and no column past a
    row's own. The same kernel as the trainer's, each row's keys in the same blocks from column 0: bitwise the
    trainer's output, and faster than the same kernel under a bias (BENCHMARKS.md, "Decode attention: fast and
    exact")."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    per_row = positions_per_row(key)
    assert per_row is not None and per_row == positions_per_row(value), "decode() takes cache views only"
    grouped = query.reshape(batch, kv_heads, groups, dim).transpose(1, 2).reshape(1, batch * groups, kv_heads, dim)
    out = _packed_attention(
        grouped,
        _packed_positions(key, per_row),
        _packed_positions(value, per_row),
        rows.query_starts,
        rows.key_starts,
        groups,
        key.shape[2],
        _scale(query, scale),
        rows.key_counts,
    )
    return out.view(batch, groups, kv_heads, -1).transpose(1, 2).reshape(batch, 1, heads, out.shape[-1])
