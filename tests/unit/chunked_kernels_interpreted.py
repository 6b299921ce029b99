"""Run by tests/unit/test_chunked_attention.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the
chunked forward and its log-sum-exp against float64, and the split decode against the forward's rows (with fewer
programs than chunks too), its arrival counters zero after each decode."""

import torch

from rlrun.kernels import chunked_attention as ca

torch.manual_seed(0)
H, KV, D, L = 4, 2, 16, 160
cu = torch.tensor([0, 70, 75, 208], dtype=torch.int32)
q, k, v = (torch.randn(208, h, D) for h in (H, KV, KV))


def reference(a, b):
    g = H // KV
    kk, vv = k[a:b].double().repeat_interleave(g, 1), v[a:b].double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * D**-0.5
    n = b - a
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv), torch.logsumexp(s, -1)


for chunk in (32, 128):  # 128: two key tiles a chunk (catches a dropped rescale)
    out, lse = ca.causal_varlen(q, k, v, cu, 133, D**-0.5, True, block_m=16, chunk=chunk)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        want, want_lse = reference(a, b)
        assert (out[a:b] - want).abs().max() < 1e-5, chunk
        assert (lse[:, a:b] - want_lse).abs().max() < 1e-5, chunk
    cache_k, cache_v = torch.zeros(3, KV, L, D), torch.zeros(3, KV, L, D)
    counts = torch.tensor([133, 100, 1], dtype=torch.int32)
    for row, c in enumerate(counts.tolist()):  # rows of sample 2 at its positions c - 1
        cache_k[row, :, :c], cache_v[row, :, :c] = k[75 : 75 + c].transpose(0, 1), v[75 : 75 + c].transpose(0, 1)
    last = torch.tensor([75 + c - 1 for c in counts.tolist()])
    for splits in (16, 2):  # every chunk a program, and two programs taking every other chunk
        ca.MAX_SPLITS = splits
        got = ca.decode(q[last], cache_k, cache_v, counts, D**-0.5, chunk=chunk)
        assert (got - out[last]).abs().max() < 1e-6, (chunk, splits)
        assert not ca._ARRIVALS[got.device][-1].any(), "the last program to arrive zeroes its counter again"
print("ok")
