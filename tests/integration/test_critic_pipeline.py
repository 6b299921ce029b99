"""The Megatron critic at PP=2 against Hugging Face: the value head lives on the last stage only, yet
every rank gets the values, the value loss and the whole gradient norm of one critic step (first-stage
embedding and layer included), on a tied-embedding Llama and a QKV-bias Qwen2. One spawn of 2 ranks."""

from __future__ import annotations

import pytest
import torch
from test_critic_model import KINDS, _hf_reference

from dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _pipeline_critic_worker(model_dirs: dict[str, str], tokens, returns, mask) -> dict:
    from rlrun.config.schema import CriticConfig, OptimizerConfig
    from rlrun.data.batch import MicroBatch
    from rlrun.megatron import make_optimizer, make_scheduler
    from rlrun.megatron.value_head import build_critic_model
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.critic import Critic

    parallel = init_distributed(tp=1, pp=2, seed=0)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = {}
    for kind, hf_dir in model_dirs.items():
        model = build_critic_model(hf_dir, parallel, "float32", seed=11)
        head = model.module.output_layer.linear if parallel.is_last_stage else None
        optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=0.0)
        scheduler = make_scheduler(optimizer, OptimizerConfig(lr=1e-3, weight_decay=0.0), num_steps=1)
        critic = Critic(settings=CriticConfig(value_clip=0.2), model=model, optimizer=optimizer, scheduler=scheduler)
        mb = MicroBatch(tokens, position_ids, mask, torch.zeros_like(mask), torch.zeros_like(mask), returns=returns)
        out[kind] = {"head": None if head is None else (head.weight.detach().clone(), head.bias.detach().clone())}
        critic.fill_values([mb])
        out[kind].update(values=mb.values, metrics=critic.train([mb], num_global_tokens=int(mask.sum())))
    destroy_distributed()
    return out


def test_pipeline_critic_matches_hf(tiny_model_dirs):
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 260, (3, 9), generator=generator)
    mask = torch.zeros(3, 8)
    mask[0, 3:] = 1.0
    mask[1, 2:6] = 1.0
    mask[2, 5:] = 1.0
    returns = torch.randn(3, 8, generator=generator) * mask
    dirs = {kind: str(tiny_model_dirs[kind]) for kind in KINDS}
    first, last = run_distributed(_pipeline_critic_worker, 2, dirs, tokens, returns, mask, all_ranks=True)
    for kind in KINDS:
        assert first[kind]["head"] is None  # the first stage holds no value head
        ref_values, ref_loss, ref_grad_norm = _hf_reference(
            tiny_model_dirs[kind], last[kind]["head"], tokens, returns, mask
        )
        for result in (first, last):
            got = result[kind]
            torch.testing.assert_close(got["values"], ref_values, rtol=0, atol=1e-5)
            assert got["metrics"]["critic/value_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
            assert got["metrics"]["critic/grad_norm"] == pytest.approx(ref_grad_norm, rel=1e-4)
