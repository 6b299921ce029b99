"""The Megatron critic at TP=2 against Hugging Face: values, value loss and the whole gradient norm of one
critic step (trunk + replicated head), on a tied-embedding Llama and a QKV-bias Qwen2; and the value head
loaded from an HF ``score.*`` tensor; the value loss descends step by step on a fixed batch. One spawn of
2 ranks for everything."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from dist_utils import run_distributed

KINDS = ("llama", "qwen2")
pytestmark = pytest.mark.slow


def _critic_worker(model_dirs: dict[str, str], scored_dir: str, tokens, returns, mask) -> dict:
    from rlrun.config.schema import CriticConfig, OptimizerConfig
    from rlrun.data.batch import MicroBatch
    from rlrun.megatron import make_optimizer, make_scheduler
    from rlrun.megatron.value_head import build_critic_model
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.critic import Critic

    parallel = init_distributed(tp=2, pp=1, seed=0)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = {}
    for kind, hf_dir in model_dirs.items():
        model = build_critic_model(hf_dir, parallel, "float32", seed=11)
        head = model.module.output_layer.linear
        initial = (head.weight.detach().clone(), head.bias.detach().clone())
        optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, clip_grad=0.0)
        scheduler = make_scheduler(optimizer, OptimizerConfig(lr=1e-3), num_steps=4)  # constant LR
        critic = Critic(settings=CriticConfig(value_clip=0.2), model=model, optimizer=optimizer, scheduler=scheduler)
        mb = MicroBatch(tokens, position_ids, mask, torch.zeros_like(mask), torch.zeros_like(mask), returns=returns)
        critic.fill_values([mb])
        metrics = critic.train([mb], num_global_tokens=int(mask.sum()))
        out[kind] = {
            "head": initial,
            "values": mb.values,
            "metrics": metrics,
            "losses": [metrics["critic/value_loss"]],
            "moved": not torch.equal(head.weight.detach(), initial[0]),
        }
        for _ in range(3):  # the same batch again: each step's old values are the last step's new ones
            critic.fill_values([mb])
            out[kind]["losses"].append(critic.train([mb], num_global_tokens=int(mask.sum()))["critic/value_loss"])
    scored = build_critic_model(scored_dir, parallel, "float32", seed=11).module.output_layer.linear
    out["scored_head"] = (scored.weight.detach().clone(), scored.bias.detach().clone())
    destroy_distributed()
    return out


def _hf_reference(hf_dir, head, tokens, returns, mask):
    """Values of HF's final hidden states through the same head; the value loss and its gradient norm."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).model
    weight, bias = (t.clone().requires_grad_(True) for t in head)
    hidden = base(tokens).last_hidden_state
    values = (hidden @ weight.T + bias)[:, :-1, 0]
    loss = (0.5 * (values - returns) ** 2 * mask).sum() / mask.sum()
    loss.backward()
    grads = [p.grad for p in base.parameters() if p.grad is not None] + [weight.grad, bias.grad]
    return values.detach() * mask, loss.item(), torch.sqrt(sum(g.square().sum() for g in grads)).item()


def test_critic_matches_hf_values_and_gradient(tiny_model_dirs, tmp_path):
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 260, (3, 9), generator=generator)
    mask = torch.zeros(3, 8)
    mask[0, 3:] = 1.0
    mask[1, 2:6] = 1.0
    mask[2, 5:] = 1.0
    returns = torch.randn(3, 8, generator=generator) * mask
    scored_dir = tmp_path / "scored"
    shutil.copytree(tiny_model_dirs["llama"], scored_dir)
    score = (torch.randn(1, 64, generator=generator), torch.tensor([0.25]))
    save_file({"score.weight": score[0], "score.bias": score[1]}, scored_dir / "score.safetensors")

    dirs = {kind: str(tiny_model_dirs[kind]) for kind in KINDS}
    ranks = run_distributed(_critic_worker, 2, dirs, str(scored_dir), tokens, returns, mask, all_ranks=True)
    for kind in KINDS:
        ref_values, ref_loss, ref_grad_norm = _hf_reference(
            tiny_model_dirs[kind], ranks[0][kind]["head"], tokens, returns, mask
        )
        for result in ranks:
            got = result[kind]
            torch.testing.assert_close(got["head"][0], ranks[0][kind]["head"][0], rtol=0, atol=0)  # replicated
            torch.testing.assert_close(got["values"], ref_values, rtol=0, atol=1e-5)
            assert got["metrics"]["critic/value_loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
            assert got["metrics"]["critic/grad_norm"] == pytest.approx(ref_grad_norm, rel=1e-4)
            assert got["metrics"]["critic/value_clip_frac"] == 0.0  # new values == old values in one step
            assert got["moved"]
            losses = got["losses"]
            assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses  # descends on a fixed batch
    for result in ranks:
        torch.testing.assert_close(result["scored_head"][0], score[0], rtol=0, atol=0)
        torch.testing.assert_close(result["scored_head"][1], score[1], rtol=0, atol=0)
