"""RoPE of queries and keys as one Triton launch (CUDA; imported only where Triton is), bit for bit the eager formula.

``x * cos + rotate_half(x) * sin`` as transformers' Llama-family ``apply_rotary_pos_emb`` and Megatron's unfused
``_apply_rotary_pos_emb_bshd`` both write it, where ``rotate_half(x) = cat(-x2, x1)``. Every product is rounded to
the tensor's dtype before the sum, as eager PyTorch's separate multiply and add kernels round, and
``enable_fp_fusion=False`` keeps the compiler from contracting them into a fused multiply-add (which would skip the
product's rounding in fp32). So the rotated tensors are the eager ones, bit for bit
(tests/gpu/test_triton_kernels_gpu.py, tests/gpu/test_rope_apply_gpu.py).

TILES: one program rotates a ``[POSITIONS, HEADS, D]`` tile, ``HEADS`` head vectors of the queries or of the keys at
each of ``POSITIONS`` consecutive (batch, position) pairs, all under the same cos and sin rows (read from memory once a
tile). The grid is (position tiles, query head blocks then key head blocks), so queries and keys still go in one launch
(the engine's decode step). ``HEADS`` is the largest power of two dividing both head counts (at most 32 at D=128), so no
head is masked; ``POSITIONS`` brings a tile to about 4,096 elements: 16-byte loads and stores where the strides allow,
every thread busy. Why: the first version ran one program per head vector (64 elements a half at D=128, 2-byte accesses,
half of its 4 warps idle, cos and sin read again for every head): a memory-bound op that reached a small fraction of
the device's bandwidth in a training step's profile (BENCHMARKS.md, "Step against peers").
scripts/gpu/rope_kernel_bench.py times the trainer's and the engine's shapes.

Used by the embedded engine (``rlrun.engine.embedded.fused_rope``) and by the trainer (``rlrun.megatron.rope_apply``,
whose backward is the same rotation with ``-sin``): the two sides rotate with the same kernel, as they attend with
the same kernel (``rlrun.kernels.attention``).

LAUNCH_DEVICE: Triton launches on the current CUDA device and its stream, so each launch runs under
:func:`rlrun.kernels.triton_support.launch_device` of its tensors (rlrun.engine.embedded.triton_kernels says why).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlrun.kernels.triton_support import launch_device

_TILE = 4096  # elements a program rotates (both halves), where the head and position counts allow


@triton.jit
def _rope_qk(
    q, k, cos, sin, q_out, k_out, BS, S, n_q_blocks,
    q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, c_sb, c_ss, s_sb, s_ss,
    oq_sb, oq_sh, oq_ss, ok_sb, ok_sh, ok_ss,
    POSITIONS: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # The tile's positions (flat over batch and sequence), heads and columns of a half, as [POSITIONS, HEADS, BLOCK].
    pos = tl.program_id(0).to(tl.int64) * POSITIONS + tl.arange(0, POSITIONS)[:, None, None]
    b, s = pos // S, pos % S
    head_block = tl.program_id(1)
    h = tl.arange(0, HEADS)[None, :, None].to(tl.int64)
    d = tl.arange(0, BLOCK)[None, None, :]
    keep = (pos < BS) & (d < HALF)  # the last tile's positions; the columns past HALF where it is no power of two
    if head_block < n_q_blocks:
        h += head_block * HEADS
        src = q + b * q_sb + h * q_sh + s * q_ss + d
        dst = q_out + b * oq_sb + h * oq_sh + s * oq_ss + d
    else:
        h += (head_block - n_q_blocks) * HEADS
        src = k + b * k_sb + h * k_sh + s * k_ss + d
        dst = k_out + b * ok_sb + h * ok_sh + s * ok_ss + d
    # cos and sin of the tile's positions, addressed for each of its heads (the same addresses): each thread loads
    # the values it multiplies, in the layout of x, and the heads of a warp share one request (a [POSITIONS, 1,
    # BLOCK] load would get a layout of its own and go through shared memory to be broadcast: 7 barriers in sm_90 PTX).
    c = tl.broadcast_to(cos + b * c_sb + s * c_ss + d, (POSITIONS, HEADS, BLOCK))
    sn = tl.broadcast_to(sin + b * s_sb + s * s_ss + d, (POSITIONS, HEADS, BLOCK))
    c1 = tl.load(c, mask=keep).to(tl.float32)
    c2 = tl.load(c + HALF, mask=keep).to(tl.float32)
    s1 = tl.load(sn, mask=keep).to(tl.float32)
    s2 = tl.load(sn + HALF, mask=keep).to(tl.float32)
    x1 = tl.load(src, mask=keep)
    x2 = tl.load(src + HALF, mask=keep)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x2, x1): each term rounded, then the sum.
    out1 = (a1 * c1).to(dtype).to(tl.float32) + ((-a2) * s1).to(dtype).to(tl.float32)
    out2 = (a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)
    tl.store(dst, out1.to(dtype), mask=keep)
    tl.store(dst + HALF, out2.to(dtype), mask=keep)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor
) -> None:
    """Write RoPE of q, k ([B, H, S, D]) under cos, sin ([B, S, D]) into q_out, k_out (same shapes)."""
    batch, q_heads, seq, dim = q.shape
    k_heads = k.shape[1]
    positions = batch * seq
    if positions == 0 or q_heads + k_heads == 0:
        return
    common = math.gcd(q_heads, k_heads)  # gcd(h, 0) = h: a call with no keys (the trainer's) or no queries
    half = dim // 2
    block = triton.next_power_of_2(half)
    # the largest power of two dividing both head counts (TILES), as many as a tile holds
    heads = min(common & -common, max(1, _TILE // (2 * block)))
    tile_positions = min(max(1, _TILE // (2 * heads * block)), triton.next_power_of_2(positions))
    grid = (triton.cdiv(positions, tile_positions), (q_heads + k_heads) // heads)
    with launch_device(q):  # LAUNCH_DEVICE
        _rope_qk[grid](
            q, k, cos, sin, q_out, k_out, positions, seq, q_heads // heads,
            *q.stride()[:3], *k.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
            *q_out.stride()[:3], *k_out.stride()[:3],
            POSITIONS=tile_positions, HEADS=heads, HALF=half, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
