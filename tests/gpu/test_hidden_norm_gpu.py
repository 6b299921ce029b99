"""The shared hidden norms (rlrun/kernels/hidden_norm.py) on the GPU, bf16: the kernel's rows are bitwise the same from
the
trainer's layout (Megatron's [tokens, 1, hidden]) and from the engine's (a prefill's [B, S, hidden], a decode step's
[B, 1, hidden], a misaligned view), within one rounding of ``F.rms_norm``, the engine's residual add in the same
launch gives the two steps' bits, and its gradients are autograd's through ``F.rms_norm``. Whole runs on both sides'
kernels: the SmolLM2 gate (tests/gpu/test_onpolicy_gpu.py) and the tiny Qwen3 one (tests/gpu/test_head_norm_gpu.py).

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_hidden_norm_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlrun.kernels.hidden_norm import add_rms_norm_hidden, kernel_takes, rms_norm_hidden

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dim", [576, 1024, 2048, 2560, 4096])
def test_both_sides_layouts_give_the_same_rows(dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8 * 37, dim, device="cuda", generator=gen).mul(3).bfloat16()
    w = torch.randn(dim, device="cuda", generator=gen).bfloat16()
    assert kernel_takes(x)
    trainer = rms_norm_hidden(x.view(-1, 1, dim), w, 1e-6).view(-1, dim)
    prefill = rms_norm_hidden(x.view(8, 37, dim), w, 1e-6).view(-1, dim)
    decode = rms_norm_hidden(x[5::37].clone().view(8, 1, dim), w, 1e-6).view(-1, dim)  # one position of each row
    shifted = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view_as(x).copy_(x)  # base 2 bytes off
    assert shifted.data_ptr() % 16
    assert torch.equal(trainer, prefill), "the engine's prefill rows are not the trainer's"
    assert torch.equal(trainer[5::37], decode), "the engine's decode rows are not the trainer's"
    assert torch.equal(trainer, rms_norm_hidden(shifted, w, 1e-6))
    reference = F.rms_norm(x.float(), (dim,), w.float(), 1e-6)
    torch.testing.assert_close(trainer.float(), reference, rtol=1e-2, atol=1e-2)  # one bf16 rounding


def test_its_gradients_are_autograds_through_rms_norm():
    x = torch.randn(300, 1, 2048, device="cuda").bfloat16()
    w = torch.randn(2048, device="cuda").bfloat16()
    grad = torch.randn(300, 1, 2048, device="cuda").bfloat16()
    ours = [t.clone().requires_grad_() for t in (x, w)]
    rms_norm_hidden(ours[0], ours[1], 1e-6).backward(grad)
    ref = [t.clone().requires_grad_() for t in (x, w)]
    F.rms_norm(ref[0], (2048,), ref[1], 1e-6).backward(grad)
    assert torch.equal(ours[0].grad, ref[0].grad)
    torch.testing.assert_close(ours[1].grad, ref[1].grad, rtol=1e-3, atol=1e-3)  # a sum over rows, its order torch's


@pytest.mark.parametrize("dim", [576, 2048, 2560])
def test_the_engines_add_and_norm_in_one_launch_are_the_two_steps(dim):
    """The engine's decoder layers (``fused_norm.fuse_residual_norms``) against the trainer's add, then norm."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x, residual = (torch.randn(64, 1, dim, device="cuda", generator=gen).mul(3).bfloat16() for _ in range(2))
    w = torch.randn(dim, device="cuda", generator=gen).bfloat16()
    with torch.no_grad():
        normed, summed = add_rms_norm_hidden(x, residual, w, 1e-6)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, rms_norm_hidden((residual + x).view(-1, 1, dim), w, 1e-6).view_as(normed))
