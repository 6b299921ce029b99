"""The embedded engine's Triton kernels (CUDA; imported only where Triton is), each one launch where eager PyTorch
took several, each the same bits.

* RoPE of the queries and keys: :mod:`rlrun.rope_kernel` (the trainer runs the same kernel).
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

from rlrun.triton_support import launch_device


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
