"""Run by tests/unit/test_hidden_norm.py under Triton's interpreter (TRITON_INTERPRET=1, CPU, fp32): the hidden-norm
kernel at power-of-two and other widths (a masked tile) within fp32 rounding of ``F.rms_norm``, the same rows from a
contiguous tensor, a strided view and a misaligned one (both copied first), and with the residual add in the same
launch the sum and the rows of the two steps."""

import torch
import torch.nn.functional as F

from rlrun.kernels.hidden_norm_kernel import add_rms_norm_hidden_rows, rms_norm_hidden_rows

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
    residual = torch.randn(3, 5, dim)
    normed, summed = add_rms_norm_hidden_rows(x, residual, weight, 1e-6)  # the add in the same launch
    assert torch.equal(summed, residual + x) and torch.equal(normed, rms_norm_hidden_rows(residual + x, weight, 1e-6))
assert rms_norm_hidden_rows(torch.empty(0, 2, 64), torch.ones(64), 1e-6).shape == (0, 2, 64)

print("ok")
