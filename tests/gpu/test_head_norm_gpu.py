"""The shared QK-norm (rlrun/kernels/head_norm.py) on the GPU, bf16: the kernel's rows are bitwise the same from the
engine's
layout (query and key heads read in place from its fused q/k/v output) and from the trainer's (Megatron's queries
reshaped contiguous, its keys a strided view of ``mixed_qkv``), within one rounding of ``F.rms_norm``, its gradients
within rounding of autograd's; and a whole run of a tiny Qwen3 (QK-norm, which the SmolLM2 gate has not) stays
on-policy at 1e-6.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_head_norm_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlrun.kernels.head_norm import kernel_takes, rms_norm_heads
from rlrun.kernels.shared_norm import aligned_rows

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]


def _layouts(tokens: int, q_heads: int, kv_heads: int, dim: int):
    """The same queries and keys as the engine sees them (views of one fused output) and as Megatron does (queries
    contiguous after its reshape, keys a view of ``mixed_qkv`` [tokens, 1, groups, (G + 2) * dim])."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(tokens, h, dim, device="cuda", generator=gen).mul(3).bfloat16()
        for h in (q_heads,) + (kv_heads,) * 2
    )
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)[:, None]  # [B, 1, W]: a decode step's output
    engine_q = fused[..., : q_heads * dim].view(tokens, 1, q_heads, dim)  # as transformers' Qwen3 views it
    engine_k = fused[..., q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, 1, kv_heads, dim)
    groups = q.view(tokens, kv_heads, q_heads // kv_heads, dim)
    mixed = torch.cat([groups, k[:, :, None], v[:, :, None]], 2).view(tokens, 1, kv_heads, -1)
    split = [q_heads // kv_heads * dim, dim, dim]
    trainer_q, trainer_k, _ = torch.split(mixed, split, dim=3)
    trainer_q = trainer_q.reshape(tokens, 1, q_heads, dim)  # a copy, as in Megatron's get_query_key_value_tensors
    return (engine_q, engine_k), (trainer_q, trainer_k), (q, k)


@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "dim"), [(64, 16, 8, 128), (1000, 32, 8, 128), (37, 4, 2, 16)]
)
def test_both_sides_layouts_give_the_same_rows(tokens, q_heads, kv_heads, dim):
    (engine_q, engine_k), (trainer_q, trainer_k), (q, k) = _layouts(tokens, q_heads, kv_heads, dim)
    assert not engine_q.is_contiguous() and not trainer_k.is_contiguous() and kernel_takes(engine_q)
    assert aligned_rows(engine_q) is not None and aligned_rows(engine_k) is not None  # read in place, not copied
    gen = torch.Generator(device="cuda").manual_seed(1)
    wq, wk = (torch.randn(dim, device="cuda", generator=gen).bfloat16() for _ in range(2))
    for ours, theirs, plain, w in ((engine_q, trainer_q, q, wq), (engine_k, trainer_k, k, wk)):
        got = rms_norm_heads(ours, w, 1e-6)
        assert torch.equal(got, rms_norm_heads(theirs, w, 1e-6).view_as(got)), "the engine's rows are not the trainer's"
        assert torch.equal(got, rms_norm_heads(plain, w, 1e-6).view_as(got))
        reference = F.rms_norm(plain, (dim,), w, 1e-6).view_as(got)
        torch.testing.assert_close(got.float(), reference.float(), rtol=1.6e-2, atol=1e-2)


def test_its_gradients_agree_with_autograd_through_rms_norm():
    x = torch.randn(300, 1, 8, 128, device="cuda").bfloat16()
    w = torch.randn(128, device="cuda").bfloat16()
    grad = torch.randn(300, 1, 8, 128, device="cuda").bfloat16()
    ours = [t.clone().requires_grad_() for t in (x, w)]
    rms_norm_heads(ours[0], ours[1], 1e-6).backward(grad)
    ref = [t.float().requires_grad_() for t in (x, w)]
    F.rms_norm(ref[0], (128,), ref[1], 1e-6).backward(grad.float())
    torch.testing.assert_close(ours[0].grad.float(), ref[0].grad, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(ours[1].grad.float(), ref[1].grad, rtol=1.6e-2, atol=0.5)  # a sum over 2,400 rows


def test_a_tiny_qwen3_bf16_colocated_run_is_on_policy(tiny_model_dirs, tmp_path):
    """Engine and trainer both on the shared QK-norm (and the chunked attention pair): the gate at 1e-6 and step 0's
    ratio of exactly 1, as for SmolLM2 (tests/gpu/test_onpolicy_gpu.py)."""
    run_dir = tmp_path / "run"
    overrides = {
        "model.path": tiny_model_dirs["qwen3"],
        "logging.run_dir": run_dir,
        "rollout.reward": f"{REPO / 'tests/fixtures/rewards.py'}:digit_fraction",
        "train.num_steps": 3,
        "algorithm.skip_tied_groups": "false",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "rlrun"]
    cmd += ["train", "configs/gpu/smollm2_bf16_colocate.yaml"]
    cmd += [a for key, value in overrides.items() for a in ("--set", f"{key}={value}")]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/logprob_gap" in r]
    assert trained and all(r["train/logprob_gap"] <= 1e-6 for r in trained)
