"""The embedded engine's decode attention by key counts (``attention_kernel.decode``) against the trainer's forward
and against the masked path it replaced, bitwise, on the GPU: the cache as the engine holds it ([rows, kv heads,
max_len, dim] buffers, read through a slice of the filled columns or a shrunk tail's first rows), each row a
sample of its own length, its query the sample's last position."""

from __future__ import annotations

import pytest
import torch

from rlrun.kernels import attention as attention_kernel
from rlrun.kernels.attention import DecodeRows, decode, positions_per_row

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 8), (32, 8), (8, 8)])
def test_decode_by_key_counts_is_bitwise_the_trainers_forward_and_the_masked_decode(dtype, heads, kv_heads):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dim, max_len, read_len = 128, 1024, 768
    lengths = [700, 1, 129, 640, 768, 64, 300, 511]  # keys each row attends to (prompt + tokens so far)
    rows = len(lengths)
    keys, values = (torch.zeros(rows, kv_heads, max_len, dim, device="cuda", dtype=dtype) for _ in range(2))
    queries, trained = [], []
    for row, n in enumerate(lengths):
        q = (torch.randn(n, heads, dim, device="cuda", generator=gen) * 0.5).to(dtype)
        k = (torch.randn(n, kv_heads, dim, device="cuda", generator=gen) * 0.5).to(dtype)
        v = torch.randn(n, kv_heads, dim, device="cuda", generator=gen).to(dtype)
        keys[row, :, :n], values[row, :, :n] = k.transpose(0, 1), v.transpose(0, 1)
        # the trainer: the sample packed after another one, so it does not start at offset 0
        before = (torch.randn(37, heads, dim, device="cuda", generator=gen) * 0.5).to(dtype)
        bounds = torch.tensor([0, 37, 37 + n], dtype=torch.int32, device="cuda")
        packed = [torch.cat([before[:, : t.shape[1]], t]) for t in (q, k, v)]
        out = attention_kernel.efficient_varlen(*packed, bounds, 37 + n, dim**-0.5)[0]
        queries.append(q[-1])
        trained.append(out[-1])
    query = torch.stack(queries)[:, :, None]  # [rows, heads, 1, dim]
    want = torch.stack(trained)
    columns = torch.arange(read_len, device="cuda")
    mask = (columns < torch.tensor(lengths, device="cuda")[:, None]).view(rows, 1, 1, read_len)
    for take in (rows, 4):  # the whole batch, and a shrunk tail's first rows (views of the same buffers)
        k, v = keys[:take, :, :read_len], values[:take, :, :read_len]
        index = DecodeRows.of(mask[:take], heads // kv_heads, positions_per_row(k))
        got = decode(query[:take], k, v, index, scale=dim**-0.5)[:, 0]
        assert torch.equal(got, want[:take]), f"{(got != want[:take]).sum()} elements differ from the trainer's"
        grouped = query[:take].reshape(take, kv_heads, heads // kv_heads, dim)
        masked = attention_kernel.masked(grouped, k, v, mask[:take], scale=dim**-0.5).reshape(take, heads, dim)
        assert torch.equal(got, masked)
