"""Run by tests/unit/test_chunked_attention.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the
trainer's ``ChunkedVarlenCoreAttention`` (``model.packed_attention: chunked_varlen``; the CUDA-only gate opened for
the interpreter) gives SDPACoreAttention's outputs, within 1e-5, for unpacked rows and for packed ones (forward
only: its backward is FlashAttention-2's, CUDA only)."""

import dataclasses

import torch

from core_attention import make_core_attention
from rlrun.kernels import attention as attention_kernel
from rlrun.kernels import chunked_attention
from rlrun.megatron.attention import ChunkedVarlenCoreAttention, SDPACoreAttention, packed_seq_params

HEADS, KV_HEADS, DIM = 4, 2, 16
reference, chunked = (
    make_core_attention(cls, HEADS, KV_HEADS, DIM) for cls in (SDPACoreAttention, ChunkedVarlenCoreAttention)
)
calls = []
kernel = chunked_attention.causal_varlen
attention_kernel.chunked_kernel_takes = lambda query, value, groups: True  # CUDA-only outside the interpreter
chunked_attention.causal_varlen = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)


def qkv(*lead: int):
    gen = torch.Generator().manual_seed(sum(lead))
    return [torch.randn(*lead, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]


with torch.no_grad():
    q, k, v = qkv(70, 3)  # [S, B, heads, dim]: unpacked rows
    torch.testing.assert_close(chunked(q, k, v, None), reference(q, k, v, None), rtol=0, atol=1e-5)
    positions = torch.cat([torch.arange(n) for n in (40, 3, 90)])[None]
    params = packed_seq_params(positions, torch.device("cpu"))
    params = dataclasses.replace(params, cu_seqlens_device=params.cu_seqlens_q)  # the varlen kernel's copy
    q, k, v = qkv(133)
    got = chunked(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(got, reference(q, k, v, None, packed_seq_params=params), rtol=0, atol=1e-5)
assert len(calls) == 2, calls
print("ok")
