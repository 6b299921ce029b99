"""Run by tests/unit/test_hidden_norm.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the hidden-norm
kernel at power-of-two and other widths (a masked tile) within fp32 rounding of ``F.rms_norm``, the same rows from a
contiguous tensor, a strided view and a misaligned one (both copied first), and its autograd function's gradients
those of autograd through ``F.rms_norm``."""

import torch
import torch.nn.functional as F

from rlrun.hidden_norm import _RmsNormHidden
from rlrun.hidden_norm_kernel import rms_norm_hidden_rows

torch.manual_seed(0)
for dim in (24, 256, 320, 1024):
    weight = torch.randn(dim)
    x = torch.randn(3, 5, dim) * 3
    got = rms_norm_hidden_rows(x, weight, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    want = F.rms_norm(x.double(), (dim,), weight.double(), 1e-6)
    assert (got.double() - want).abs().max() < 1e-5, dim
    strided = torch.randn(5, 3, dim).transpose(0, 1)  # [3, 5, dim], rows not in order
    shifted = torch.randn(1 + 4 * dim)[1:].view(4, dim)  # base 4 bytes past an allocation: not 16-byte aligned
    for view in (strided, shifted):  # both copied first
        assert torch.equal(
            rms_norm_hidden_rows(view, weight, 1e-6),
            rms_norm_hidden_rows(view.clone(memory_format=torch.contiguous_format), weight, 1e-6),
        )
assert rms_norm_hidden_rows(torch.empty(0, 2, 64), torch.ones(64), 1e-6).shape == (0, 2, 64)

x = torch.randn(4, 2, 64, dtype=torch.float64) * 2
w = torch.randn(64, dtype=torch.float64)
grad = torch.randn(4, 2, 64, dtype=torch.float64)
x32, w32, grad32 = (t.float() for t in (x, w, grad))
for needs_w in (True, False):
    a, b = x32.clone().requires_grad_(), w32.clone().requires_grad_(needs_w)
    _RmsNormHidden.apply(a, b, 1e-6).backward(grad32)
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_(needs_w)
    F.rms_norm(ref_x, (64,), ref_w, 1e-6).backward(grad)
    assert (a.grad.double() - ref_x.grad).abs().max() < 1e-4
    assert (b.grad is None) if not needs_w else (b.grad.double() - ref_w.grad).abs().max() < 1e-4
print("ok")
