"""The embedded engine's Triton kernels (CUDA; imported only where Triton is), each one launch where eager PyTorch
took several, each the same bits.

* :func:`rope_qk`, behind :func:`rlrun.engine.backends.fused_rope.rope_qk`: one program rotates one head vector of
  one position, the query rows first, then the key rows, so a layer's RoPE is one launch. Every product is rounded
  to the tensor's dtype before the sum, as eager PyTorch's separate multiply and add kernels round, and
  ``enable_fp_fusion=False`` keeps the compiler from contracting them into a fused multiply-add (which would skip
  the product's rounding in fp32).
* :func:`write_kv_columns`, behind ``StaticKVCache.update`` in a decode step: each row's new key and value go to
  that row's own cache column in one launch instead of two ``scatter_`` calls (a copy: nothing is computed).

LAUNCH_DEVICE: Triton launches on the current CUDA device and that device's current stream, not on its tensors'
device, and the current device is per host thread: the embedded backend decodes on a thread of its own, where it
is cuda:0 unless set, while rank 1's engine holds its tensors on cuda:1. Each launch therefore runs under
``torch.cuda.device`` of its tensors (a no-op where they agree), as PyTorch's own ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(src, dst, cos, sin, HALF: tl.constexpr, BLOCK: tl.constexpr):
    d = tl.arange(0, BLOCK)
    keep = d < HALF
    x1 = tl.load(src + d, mask=keep)
    x2 = tl.load(src + HALF + d, mask=keep)
    c1 = tl.load(cos + d, mask=keep).to(tl.float32)
    c2 = tl.load(cos + HALF + d, mask=keep).to(tl.float32)
    s1 = tl.load(sin + d, mask=keep).to(tl.float32)
    s2 = tl.load(sin + HALF + d, mask=keep).to(tl.float32)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1): each term rounded, then the sum.
    out1 = (a1 * c1).to(dtype).to(tl.float32) + ((-a2) * s1).to(dtype).to(tl.float32)
    out2 = (a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)
    tl.store(dst + d, out1.to(dtype), mask=keep)
    tl.store(dst + HALF + d, out2.to(dtype), mask=keep)


@triton.jit
def _rope_qk(
    q, k, cos, sin, q_out, k_out, n_q_rows, HQ, HK, S,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, c_sb, c_ss, s_sb, s_ss,
    oq_sb, oq_sh, oq_ss, ok_sb, ok_sh, ok_ss,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if row < n_q_rows:
        s, h, b = row % S, (row // S) % HQ, row // (S * HQ)
        _rotate(
            q + b * q_sb + h * q_sh + s * q_ss, q_out + b * oq_sb + h * oq_sh + s * oq_ss,
            cos + b * c_sb + s * c_ss, sin + b * s_sb + s * s_ss, HALF, BLOCK,
        )  # fmt: skip
    else:
        row -= n_q_rows
        s, h, b = row % S, (row // S) % HK, row // (S * HK)
        _rotate(
            k + b * k_sb + h * k_sh + s * k_ss, k_out + b * ok_sb + h * ok_sh + s * ok_ss,
            cos + b * c_sb + s * c_ss, sin + b * s_sb + s * s_ss, HALF, BLOCK,
        )  # fmt: skip


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor
) -> None:
    """Write RoPE of q, k ([B, H, S, D]) under cos, sin ([B, S, D]) into q_out, k_out (same shapes)."""
    batch, q_heads, seq, dim = q.shape
    k_heads = k.shape[1]
    n_q_rows = batch * q_heads * seq
    rows = n_q_rows + batch * k_heads * seq
    if rows == 0:
        return
    with torch.cuda.device(q.device):  # Triton launches on the current device and its stream (LAUNCH_DEVICE)
        _rope_qk[(rows,)](
            q, k, cos, sin, q_out, k_out, n_q_rows, q_heads, k_heads, seq,
            *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
            *q_out.stride()[:3], *k_out.stride()[:3],
            HALF=dim // 2, BLOCK=triton.next_power_of_2(dim // 2), enable_fp_fusion=False,
        )  # fmt: skip


@triton.jit
def _copy(src, dst, D: tl.constexpr, BLOCK: tl.constexpr):
    d = tl.arange(0, BLOCK)
    keep = d < D
    tl.store(dst + d, tl.load(src + d, mask=keep), mask=keep)


@triton.jit
def _write_kv(
    key, value, key_cache, value_cache, columns, n_key_rows, HK, HV,
    k_sr, k_sh, v_sr, v_sh, kc_sr, kc_sh, kc_sc, vc_sr, vc_sh, vc_sc,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    if pid < n_key_rows:
        r, h = pid // HK, pid % HK
        column = tl.load(columns + r)
        _copy(key + r * k_sr + h * k_sh, key_cache + r * kc_sr + h * kc_sh + column * kc_sc, DK, BK)
    else:
        pid -= n_key_rows
        r, h = pid // HV, pid % HV
        column = tl.load(columns + r)
        _copy(value + r * v_sr + h * v_sh, value_cache + r * vc_sr + h * vc_sh + column * vc_sc, DV, BV)


def write_kv_columns(
    key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor
) -> None:
    """``cache[r, :, columns[r]] = new[r, :, 0]`` for the keys and the values ([rows, heads, 1, dim] each) at once."""
    rows, k_heads, _, k_dim = key.shape
    v_heads, v_dim = value.shape[1], value.shape[-1]
    n_key_rows = rows * k_heads
    if rows == 0:
        return
    with torch.cuda.device(key.device):  # LAUNCH_DEVICE
        _write_kv[(n_key_rows + rows * v_heads,)](
            key, value, key_cache, value_cache, columns, n_key_rows, k_heads, v_heads,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            DK=k_dim, DV=v_dim, BK=triton.next_power_of_2(k_dim), BV=triton.next_power_of_2(v_dim),
        )  # fmt: skip
