"""Run by tests/unit/test_head_norm.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the head-norm
kernel on the engine's layout (heads read in place from a fused q/k/v output, at a prefill's positions and at a
decode step's one), on a contiguous copy and on a
misaligned view (copied first) gives the same rows, each within fp32 rounding of ``F.rms_norm``."""

import torch
import torch.nn.functional as F

from rlrun.kernels.head_norm_kernel import rms_norm_rows

torch.manual_seed(0)
B, S, HQ, HKV, D = 3, 5, 4, 2, 32
weight = torch.randn(D)
cases = [(positions, start, heads) for positions in (S, 1) for start, heads in ((0, HQ), (HQ * D, HKV))]
for positions, start, heads in cases:  # a prefill's and a decode step's queries and keys, as views (no copy)
    fused = torch.randn(B, positions, (HQ + 2 * HKV) * D)  # the engine's q/k/v output, [batch, positions, columns]
    view = fused[..., start : start + heads * D].view(B, positions, heads, D)
    assert not view.is_contiguous()
    got = rms_norm_rows(view, weight, 1e-6)
    assert got.is_contiguous() and got.shape == view.shape
    assert torch.equal(got, rms_norm_rows(view.contiguous(), weight, 1e-6)), "a row's result depends on its layout"
    want = F.rms_norm(view.double(), (D,), weight.double(), 1e-6)
    assert (got.double() - want).abs().max() < 1e-5
shifted = torch.randn(1 + 6 * D)[1:].view(6, D)  # base 4 bytes past an allocation: not 16-byte aligned
assert torch.equal(rms_norm_rows(shifted, weight, 1e-6), rms_norm_rows(shifted.clone(), weight, 1e-6))
assert rms_norm_rows(torch.empty(0, 2, D), weight, 1e-6).shape == (0, 2, D)
print("ok")
