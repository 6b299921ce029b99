"""The embedded engine's Triton kernels (CUDA; imported only where Triton is), each one launch where eager PyTorch
took several, each the same bits.

* RoPE of the queries and keys: :mod:`rlrun.kernels.rope` (the trainer runs the same kernel).
* :func:`write_kv_columns`, behind ``StaticKVCache.update`` in a decode step: each row's new key and value go to
  that row's own cache column in one launch instead of two ``scatter_`` calls (a copy: nothing is computed).
* :func:`greedy_tokens`, behind ``sampling.sample_tokens`` when no row draws at random: each row's first argmax and
  its log-prob in one launch that reads the logits twice, where the eager path wrote the logits over in fp32
  twice (the temperature division, ``log_softmax``) before its argmax (BENCHMARKS.md, "Rollout engine, earlier
  runs": the profiled decode steps). Not the same bits as ``log_softmax``:
  the log-prob is the trainer's formula (``rlrun.megatron.token_stats``: ``z = logits / T`` as a multiply by
  ``1 / T``, ``-log sum exp(z - max z)`` for the argmax), fp32 sums in another order.

LAUNCH_DEVICE: Triton launches on the current CUDA device and that device's current stream, not on its tensors'
device, and the current device is per host thread: the embedded backend decodes on a thread of its own, where it
is cuda:0 unless set, while rank 1's engine holds its tensors on cuda:1. Each launch therefore runs under
``torch.cuda.device`` of its tensors (a no-op where they agree), as PyTorch's own ops do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrun.kernels.triton_support import launch_device


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
    with launch_device(key):  # LAUNCH_DEVICE
        _write_kv[(n_key_rows + rows * v_heads,)](
            key, value, key_cache, value_cache, columns, n_key_rows, k_heads, v_heads,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), *key_cache.stride()[:3],
            *value_cache.stride()[:3],
            DK=k_dim, DV=v_dim, BK=triton.next_power_of_2(k_dim), BV=triton.next_power_of_2(v_dim),
        )  # fmt: skip


GREEDY_BLOCK = 4096
"""Vocabulary columns a greedy program reads an iteration (``token_stats_triton.BLOCK``, the trainer's)."""


@triton.jit
def _greedy(logits, row_stride, temperature, tokens, logprobs, n_cols, BLOCK: tl.constexpr):
    """Row ``program_id``: the first column of the largest logit, and ``-log sum_v exp(z_v - z_max)``."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * row_stride
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        u = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        better = u > best  # strictly: each lane keeps its first column of its largest value
        best, best_at = tl.where(better, u, best), tl.where(better, cols, best_at)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_at, n_cols), axis=0)  # the first of the lanes holding it
    inv_t = tl.math.div_rn(1.0, tl.load(temperature + row))
    shift = top * inv_t
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        keep = cols < n_cols
        z = tl.load(base + cols, mask=keep, other=0.0).to(tl.float32) * inv_t - shift
        total += tl.where(keep, tl.exp(z), 0.0)
    tl.store(tokens + row, token.to(tl.int64))
    tl.store(logprobs + row, -tl.log(tl.sum(total, axis=0)))  # the argmax's z - z_max is 0


def greedy_tokens(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first argmax of ``logits [B, V]`` (unit column stride) and its log-prob under
    ``softmax(logits / temperature)`` (fp32)."""
    rows, cols = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        with launch_device(logits):  # LAUNCH_DEVICE
            _greedy[(rows,)](
                logits, logits.stride(0), temperature, tokens, logprobs, cols, BLOCK=GREEDY_BLOCK, num_warps=8
            )
    return tokens, logprobs
