"""The long-response options on CUDA in bf16: the chunked LM head and activation recompute take the step of the
plain one, and optimizer state offload (Megatron's HybridDeviceOptimizer, the distributed optimizer) the step of
the on-device Adam; every option builds and steps on first contact with a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.gpu
TEMPERATURE = 0.8
VARIANTS = (
    # (lm_head, recompute, cpu_offload)
    ("logits", "none", False),
    ("chunked", "none", False),
    ("chunked", "selective", False),
    ("chunked", "full", False),
    ("chunked", "full", True),
)


def _loss(batch, logprobs, entropy):
    mask = batch.mask.to(logprobs.device)
    return -((logprobs - 0.1 * entropy) * mask).sum(), {"tokens": mask.sum()}


@dataclass
class Batch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    mask: torch.Tensor


def _worker(hf_dir: str) -> dict:
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.megatron.hf_config import ModelArch
    from rlrun.megatron.recompute import Recompute
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ModelArch.from_hf_dir(hf_dir).vocab_size, (1, 96), generator=gen)
    positions = torch.cat([torch.arange(40), torch.arange(56)]).unsqueeze(0)  # two packed samples
    batch = Batch(tokens, positions, torch.ones(1, 95))
    results = {}
    for lm_head, mode, offload in VARIANTS:
        model = build_model(
            hf_dir, parallel, "bfloat16", distributed_optimizer=True, recompute=Recompute(mode), lm_head=lm_head
        )
        optimizer = make_optimizer(model, 1e-4, 0.0, (0.9, 0.95), 1e-8, 1.0, cpu_offload=offload)
        stats = [train_step(model, optimizer, [batch], _loss, 95, TEMPERATURE, with_entropy=True) for _ in range(2)]
        weights = {k: v.float().cpu() for k, v in export_hf_weights(model)}
        results[(lm_head, mode, offload)] = {"stats": stats, "weights": weights}
    destroy_distributed()
    return results


def test_memory_options_take_the_same_bf16_steps(tiny_model_dirs):
    results = run_distributed(_worker, 1, str(tiny_model_dirs["qwen3"]))
    want = results[VARIANTS[0]]
    for variant in VARIANTS[1:]:
        got = results[variant]
        for got_step, want_step in zip(got["stats"], want["stats"], strict=True):
            assert got_step["loss"] == pytest.approx(want_step["loss"], rel=2e-2, abs=2e-3), variant
            assert got_step["grad_norm"] == pytest.approx(want_step["grad_norm"], rel=5e-2), variant
        for name, tensor in want["weights"].items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=2e-2, atol=2e-3, msg=f"{variant} {name}")
