"""MoE routing replay on a real Megatron Qwen3-MoE (gloo, 1 process) against a real embedded engine.

The engine's router weights are perturbed slightly, so the engine and the trainer route some tokens to
different experts. With ``routing_replay: rollout`` every token the trainer forwards (old-policy forward
and training forward, packed rows and plain rows) must take exactly the engine's experts, and the
trainer-vs-engine log-prob gap must shrink against the same batch without replay (where flips must occur).
``trainer`` mode replays the old forward's recorded routing in the training forward (same order and
layout; at unchanged weights the trainer's own routing is the same, so this checks the plumbing only).
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow
TEMPERATURE = 1.0


def _engine_samples(hf_dir: str):
    """Samples from an engine whose router weights differ slightly from the trainer's; equal prompt
    lengths and ignore_eos give equal sample lengths (for a plain 2-row micro-batch)."""
    from minimal_config import rollout_config
    from rlrun.data.sample import Prompt
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from rlrun.rollout.driver import generate_samples
    from tiny_models import make_tokenizer

    engine = EmbeddedEngine(hf_dir, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(0.15 * param.abs().mean() * torch.randn(param.shape, generator=gen))
    prompts = [Prompt(index=i, prompt_ids=[(7 * i + j) % 250 for j in range(6)], prompt_text="") for i in range(3)]
    cfg = rollout_config(max_new_tokens=12, temperature=TEMPERATURE, samples_per_prompt=2, top_p=1.0)
    engine.eos_token_ids = set()  # fixed lengths: no sample ends early
    return generate_samples(engine, prompts, cfg, seed=5, tokenizer=make_tokenizer())


def _micro_batches(samples):
    """One packed row of four samples and one plain 2-row micro-batch (sbhd token order)."""
    from rlrun.data.batch import MicroBatch, collate

    packed = collate(samples[:4], [1.0, -1.0, 0.5, -0.5], pad_token_id=0)
    rows = [collate([s], [1.0], pad_token_id=0) for s in samples[4:]]
    plain = MicroBatch(
        **{
            f: torch.cat([getattr(r, f) for r in rows])
            for f in ("tokens", "position_ids", "loss_mask", "advantages", "rollout_logprobs", "routed_experts")
        }
    )
    return [packed, plain]


def _capture_routing(model):
    """Hooks on the Megatron routers: per forward, the expert ids each router actually used ([N, k] sorted)."""
    from megatron.core.transformer.moe.router import TopKRouter

    captured: list[torch.Tensor] = []
    for module in model.module.modules():
        if isinstance(module, TopKRouter):

            def hook(mod, _args, output):
                routing_map = output[1]
                captured.append(routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1).cpu())

            module.register_forward_hook(hook)
    return captured


def _engine_order(mb, layers: list[int]) -> list[torch.Tensor]:
    """The engine's sorted ids in the router's token order, for the given (this stage's) layers."""
    experts = mb.routed_experts
    if mb.position_ids.shape[0] > 1:
        experts = experts.transpose(0, 1)
    flat = experts.reshape(-1, *experts.shape[2:]).sort(-1).values.long()
    return [flat[:, layer] for layer in layers]


def _real_tokens(mb, lengths: list[int]) -> torch.Tensor:
    """[N] bool in the router's order: tokens the engine forwarded (all but each sample's last; no padding).
    ``lengths``: the samples' total lengths, packed back to back in one row or one per plain row."""
    real = torch.zeros(mb.tokens.shape, dtype=torch.bool)
    offsets = [0] * len(lengths) if mb.tokens.shape[0] > 1 else [sum(lengths[:i]) for i in range(len(lengths))]
    for i, (offset, length) in enumerate(zip(offsets, lengths, strict=False)):
        real[i if mb.tokens.shape[0] > 1 else 0, offset : offset + length - 1] = True
    return (real.t() if mb.tokens.shape[0] > 1 else real).reshape(-1)


def _worker(hf_dir: str, pp: int) -> dict:
    from rlrun.algo.aggregate import StepCounts
    from rlrun.algo.objective import Objective
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.megatron import build_model, compute_logprobs, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.trainer.roles import ModelRoles

    torch.set_num_threads(1)
    samples = _engine_samples(hf_dir)
    parallel = init_distributed(tp=1, pp=pp, seed=0)
    model = build_model(hf_dir, parallel)
    per_stage = samples[0].routed_experts.shape[1] // pp  # this stage's MoE layers (all layers are MoE here)
    stage_layers = list(range(parallel.pp_rank * per_stage, (parallel.pp_rank + 1) * per_stage))
    layers = len(stage_layers)
    captured = _capture_routing(model)
    mbs = _micro_batches(samples)
    out = {"flips_off": 0, "real": 0, "mismatch_on": 0, "mismatch_train": 0}

    def gap(field_or_lp, mb):
        mask = mb.loss_mask > 0
        return (field_or_lp.cpu()[mask] - mb.rollout_logprobs[mask]).abs().mean().item()

    with torch.no_grad():  # replay off: the trainer routes on its own
        off = []
        for mb, group in zip(mbs, (samples[:4], samples[4:]), strict=False):
            captured.clear()
            off.append(gap(compute_logprobs(model, mb.tokens, mb.position_ids, TEMPERATURE), mb))
            real = _real_tokens(mb, [s.total_length for s in group])
            out["real"] += int(real.sum()) * layers
            pairs = zip(captured, _engine_order(mb, stage_layers), strict=False)
            out["flips_off"] += sum(int((c != e).any(-1)[real].sum()) for c, e in pairs)
    roles = ModelRoles.create(AlgorithmConfig(routing_replay="rollout", use_rollout_logprobs=False), model)
    roles.reuse_logprobs = False
    captured.clear()
    roles.fill_logprobs(mbs, TEMPERATURE)  # old log-probs with the engine's routing replayed
    used = [captured[i * layers : (i + 1) * layers] for i in range(len(mbs))]
    for mb, routing in zip(mbs, used, strict=False):
        out["mismatch_on"] += sum(
            int((c != e).any(-1).sum()) for c, e in zip(routing, _engine_order(mb, stage_layers), strict=False)
        )
    out["gap_off"], out["gap_on"] = sum(off) / len(off), sum(gap(mb.old_logprobs, mb) for mb in mbs) / len(mbs)

    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0)
    num_tokens = int(sum(mb.num_loss_tokens for mb in mbs))
    captured.clear()
    with roles.training_forward(mbs):
        train_step(
            model,
            optimizer,
            mbs,
            Objective(roles.cfg, StepCounts(num_tokens, 6, 12)),
            num_tokens,
            TEMPERATURE,
            with_entropy=True,
        )
    for i, mb in enumerate(mbs):
        routing = captured[i * layers : (i + 1) * layers]
        out["mismatch_train"] += sum(
            int((c != e).any(-1).sum()) for c, e in zip(routing, _engine_order(mb, stage_layers), strict=False)
        )

    trainer = ModelRoles.create(AlgorithmConfig(routing_replay="trainer"), model)
    trainer.reuse_logprobs = False
    captured.clear()
    trainer.fill_logprobs(mbs, TEMPERATURE)
    recorded = [c.clone() for c in captured]
    captured.clear()
    with trainer.training_forward(mbs):
        train_step(
            model,
            optimizer,
            mbs,
            Objective(trainer.cfg, StepCounts(num_tokens, 6, 12)),
            num_tokens,
            TEMPERATURE,
            with_entropy=True,
        )
    out["r2_equal"] = all(torch.equal(a, b) for a, b in zip(recorded, captured, strict=False)) and len(recorded) == len(
        captured
    )
    destroy_distributed()
    return out


@pytest.mark.parametrize("pp", [1, 2])
def test_rollout_replay_takes_engine_experts_and_shrinks_logprob_gap(tmp_path, pp):
    """PP=2: each stage's router replays its own layer's slice; the log-probs come from the last stage."""
    hf_dir = make_tiny_model("qwen3_moe", tmp_path / "moe", seed=1)
    per_rank = run_distributed(_worker, pp, str(hf_dir), pp, all_ranks=True)
    print(per_rank)
    assert sum(out["flips_off"] for out in per_rank) > 0, "the perturbed engine must flip some routing"
    for out in per_rank:
        assert out["mismatch_on"] == 0 and out["mismatch_train"] == 0
        assert out["gap_on"] < 0.5 * out["gap_off"]
        assert out["r2_equal"]
