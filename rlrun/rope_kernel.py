"""RoPE of queries and keys as one Triton launch (CUDA; imported only where Triton is), bit for bit the eager formula.

``x * cos + rotate_half(x) * sin`` as transformers' Llama-family ``apply_rotary_pos_emb`` and Megatron's unfused
``_apply_rotary_pos_emb_bshd`` both write it, where ``rotate_half(x) = cat(-x2, x1)``. One program rotates one head
vector of one position, the query rows first, then the key rows. Every product is rounded to the tensor's dtype
before the sum, as eager PyTorch's separate multiply and add kernels round, and ``enable_fp_fusion=False`` keeps the
compiler from contracting them into a fused multiply-add (which would skip the product's rounding in fp32). So the
rotated tensors are the eager ones, bit for bit (tests/gpu/test_triton_kernels_gpu.py).

Used by the embedded engine (``rlrun.engine.backends.fused_rope``) and by the trainer (``rlrun.megatron.rope_apply``,
whose backward is the same rotation with ``-sin``): the two sides rotate with the same kernel, as they attend with
the same kernel (``rlrun.attention_kernel``).

LAUNCH_DEVICE: Triton launches on the current CUDA device and its stream, so each launch runs under
``torch.cuda.device`` of its tensors (rlrun.engine.backends.triton_kernels says why).
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
