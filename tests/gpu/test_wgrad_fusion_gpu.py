"""On a GPU, the decoder's weight gradients are accumulated by their GEMM into the fp32 ``main_grad``
(rlrun/megatron/wgrad_fusion.py) and equal the unfused path's (bf16 gradient per micro-batch, then DDP's add) to bf16
rounding, the tied embedding's gradient included.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_wgrad_fusion_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from policy_rows import policy_loss, random_rows
from tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _main_grads_worker(hf_dir: str, fuse: bool) -> dict:
    """One step of two micro-batches on a bf16 model, the fusion on or off; every weight's ``main_grad`` after it."""
    from rlrun.megatron import build_model, make_optimizer, train_step, wgrad_fusion
    from rlrun.runtime.dist import init_distributed

    if not fuse:
        wgrad_fusion.fuse_weight_gradient_accumulation = lambda gpt: 0  # the unfused reference
    parallel = init_distributed(tp=1, pp=1, seed=0)
    model = build_model(hf_dir, parallel, dtype="bfloat16")
    gpt = model.ddp.module
    fused = sum(getattr(m, "gradient_accumulation_fusion", False) for m in gpt.decoder.modules())
    optimizer = make_optimizer(model, lr=0.0, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, clip_grad=1e9)
    rows, seq = 4, 96
    gen = torch.Generator().manual_seed(0)
    batches = [random_rows(rows, seq, 200, parallel.device, gen) for _ in range(2)]
    train_step(model, optimizer, batches, policy_loss, 2 * rows * (seq - 1), temperature=1.0)
    grads = {name: p.main_grad.detach().float().cpu() for name, p in gpt.named_parameters() if p.requires_grad}
    return {"fused": fused, "grads": grads}


def test_fused_weight_gradients_equal_the_unfused_ones(tmp_path):
    model_dir = make_tiny_model("qwen3", tmp_path / "m", tie=True)
    fused = run_distributed(_main_grads_worker, 1, str(model_dir), True)
    plain = run_distributed(_main_grads_worker, 1, str(model_dir), False)
    assert plain["fused"] == 0 and fused["fused"] >= 4 * 2, fused["fused"]  # qkv, proj, fc1, fc2 in every layer
    assert fused["grads"].keys() == plain["grads"].keys()
    for name, reference in plain["grads"].items():
        got = fused["grads"][name]
        scale = reference.abs().max().item()
        assert scale > 0, name  # every weight got a gradient, the tied embedding's among them
        # unfused: each micro-batch's gradient rounded to bf16 (relative 2^-8) before the fp32 sum
        assert (got - reference).abs().max().item() <= 2e-2 * scale, name


def test_the_gemm_adds_onto_the_fp32_gradient_in_place():
    """``main_grad += grad_output^T @ input`` with bf16 operands, fp32 accumulation, written where main_grad is."""
    from rlrun.megatron.wgrad_fusion import _WgradGemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(333, 96, device="cuda", generator=gen).bfloat16()
    g = torch.randn(333, 160, device="cuda", generator=gen).bfloat16()
    start = torch.randn(160, 96, device="cuda", generator=gen)
    main_grad = start.clone()
    pointer = main_grad.data_ptr()
    _WgradGemm.wgrad_gemm_accum_fp32(x, g, main_grad)
    expected = start.double() + g.double().t() @ x.double()
    assert main_grad.data_ptr() == pointer and main_grad.dtype == torch.float32
    assert (main_grad.double() - expected).abs().max().item() < 1e-3 * expected.abs().max().item()
