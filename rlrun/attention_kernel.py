"""The one attention kernel the trainer and the embedded engine share on CUDA, so that their log-probs agree.

Why: torch SDPA picks its kernel per call (cuDNN, FlashAttention-2, memory-efficient, math) from the inputs,
the GPU and the torch version. The engine attends under a boolean mask (left-padded prefill, a KV cache
read under a column mask), so it never gets FlashAttention; the trainer attends causally without a mask.
When the two sides run different kernels, each attention output can round differently in bf16, and 30
layers amplify that to the whole bf16-vs-fp32 difference of a model (0.03-0.05 nats per token on
SmolLM2-135M with the trainer on FlashAttention's varlen kernel, BENCHMARKS.md "On-policy exactness").

So on CUDA both sides call the memory-efficient (xformers/cutlass) kernel directly, never through SDPA's
choice: the trainer as one varlen call per layer over a packed row (``cu_seqlens``, causal), the engine
with its mask as an additive bias. One query row's result in that kernel depends only on its own
scores and on how its keys fall into the kernel's key blocks, which start at the sample's first key on
both sides when the prompt is not left-padded. Then the two forwards are bitwise equal, whatever the
number of queries per call (decode's one token, the trainer's whole sequence) and whatever other
samples share the call. A left-padded prompt (shorter than the longest in its engine batch) shifts its
keys against those blocks: still the same kernel, but its sums are split differently, so rare bf16
roundings differ (measured in BENCHMARKS.md).

The kernel also runs in float32 (FlashAttention does not), so fp32 CUDA runs pack too. On CPU everything
stays on ``torch.nn.functional.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    bounded by ``cu_seqlens`` (int32, on the device). Differentiable (torch's efficient-attention backward)."""
    if not kernel_has_head_dims(query.dtype, query.shape[-1], value.shape[-1]):
        raise ValueError(
            f"model.packed_attention efficient_varlen: the memory-efficient kernel has no {query.dtype} kernel for "
            f"heads {query.shape[-1]} (query) and {value.shape[-1]} (value) wide (it needs multiples of "
            f"{KERNEL_ALIGN_BYTES} bytes); use model.packed_attention: per_sample"
        )
    heads = query.shape[1]
    key, value = (_repeat_heads(t, heads, 1) for t in (key, value))
    out = torch.ops.aten._efficient_attention_forward(
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
        torch.is_grad_enabled() and query.requires_grad,
        scale=_scale(query, scale),
    )[0]
    return out.squeeze(0)


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
