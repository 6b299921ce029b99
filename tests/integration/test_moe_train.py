"""One Megatron train step on the tiny Qwen3-MoE: expert parallelism changes nothing.

Reference: the same step at EP=1 (two data-parallel ranks, every rank holding all 4 experts) against EP=2
(the same two ranks, two experts each, tokens exchanged by the all-gather dispatcher). Same global batch,
same rows per rank, the load-balancing aux loss on (the checkpoint's ``router_aux_loss_coef``); gradient
clipping is active so a wrong gradient scale shows in the weights as well as in the norm. The logged
load-balancing loss is checked against the Switch formula on HF's router logits.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_train import OPTIM, TEMPERATURE, make_batch, pg_loss

from dist_utils import run_distributed

pytestmark = pytest.mark.slow


def _train_worker(hf_dir: str, ep: int, batch) -> dict:
    from rlrun.megatron import build_model, export_hf_weights, make_optimizer, train_step
    from rlrun.megatron.moe import aux_loss_metrics
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0, ep=ep)
    rows = batch.tokens.shape[0] // parallel.dp_size
    local = batch.rows(parallel.dp_rank * rows, (parallel.dp_rank + 1) * rows, parallel.device)
    model = build_model(hf_dir, parallel)
    optimizer = make_optimizer(model, **OPTIM)
    stats = train_step(
        model, optimizer, [local.rows(0, 1), local.rows(1, 2)], pg_loss, int(batch.loss_mask.sum()), TEMPERATURE
    )
    if "moe_load_balancing_loss" not in stats:  # train_step logs it once train.py calls aux_loss_metrics
        stats.update(aux_loss_metrics(model.arch.moe, num_micro_batches=2))
    weights = {k: v.cpu() for k, v in export_hf_weights(model)}
    destroy_distributed()
    return {"stats": stats, "weights": weights}


def switch_aux_loss(hf_dir, tokens: torch.Tensor) -> float:
    """The Switch-Transformer load-balancing loss (before its coefficient) of each row on its own, from HF's
    router logits, averaged over layers and rows: ``E / (k T^2) * sum_e (sum_t p_te) * count_e`` with
    ``p`` the softmax over all experts and ``count_e`` the tokens whose top-k holds ``e``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    losses = []
    with torch.no_grad():
        for row in tokens:
            for logits in model(row[None], output_router_logits=True).router_logits:
                probs = logits.softmax(-1)
                counts = torch.zeros(experts).index_add_(0, probs.topk(k).indices.flatten(), torch.ones(k * len(row)))
                losses.append(float(experts / (k * len(row) ** 2) * (probs.sum(0) * counts).sum()))
    return sum(losses) / len(losses)


WEIGHT_ATOL = 5e-6
"""fp32 rounding, amplified by Adam's eps; 0.5% of the step (lr = 1e-3 per element), so a lost, swapped or
misrouted gradient still fails by orders of magnitude (the grad norm, checked at rel 1e-5, catches scale errors).

EP=2 combines the experts' outputs through the all-gather dispatcher's reduce-scatter, EP=1 locally: the sums
run in another order, so the forward differs in the last bit (loss -4.4051199 vs -4.40512037) and the fp32
gradients by at most 5e-7 of each tensor's largest entry. In float64 the two layouts' gradients agree to 7e-16
of it, so there is no systematic difference. Adam's first step is ``lr * g / (|g| + eps)``: saturated (= lr) where
the clipped gradient is far above eps, but linear with slope ``lr / eps = 1000`` where it is below eps, so there a
gradient rounding difference ``d`` moves the weight by up to ``1000 * (clip / grad_norm) * d = 74 d``. Measured
(torch 2.13 CPU, megatron-core 0.16.1, transformers 5.24 and 5.17 alike): 1.22e-6 on one model.embed_tokens
element of 24576 (clipped gradient 1.1e-6, gradient difference 7.2e-8; the formula predicts 1.217e-6), 8.2e-7 on
one linear_qkv element, every element with a clipped gradient above 100 eps within 7.5e-9. It crossed the
former 1e-6 when the aux-loss gradient got its right scale (6fa965a), which changed the gradients: before,
the largest difference was 1.0e-7."""


@pytest.fixture(scope="module")
def batch():
    return make_batch(vocab_size=264, rows=4, seq=12)


def test_ep2_train_step_equals_ep1(tiny_moe_dir, batch):
    ep1 = run_distributed(_train_worker, 2, str(tiny_moe_dir), 1, batch, all_ranks=True)
    ep2 = run_distributed(_train_worker, 2, str(tiny_moe_dir), 2, batch, all_ranks=True)
    reference = ep1[0]
    assert reference["stats"]["moe_load_balancing_loss"] == pytest.approx(
        switch_aux_loss(tiny_moe_dir, batch.tokens), rel=1e-5
    )
    assert reference["stats"]["grad_norm"] > OPTIM["clip_grad"]  # clipping is active
    for result in ep1[1:] + ep2:
        assert result["stats"].keys() == reference["stats"].keys()
        for name, value in reference["stats"].items():
            assert result["stats"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
        assert result["weights"].keys() == reference["weights"].keys()
        for name, tensor in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=name)
    moved = reference["weights"]["model.layers.0.mlp.experts.3.down_proj.weight"]
    from safetensors.torch import load_file

    assert not torch.equal(
        moved, load_file(tiny_moe_dir / "model.safetensors")["model.layers.0.mlp.experts.3.down_proj.weight"]
    )  # the step updated the experts


AUX_COEFF = 0.5
"""Large, so the load-balancing term moves the gradient norm far beyond the tolerance."""


def _grad_norm_worker(hf_dir: str, batch) -> float:
    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.megatron.moe import MoEOptions
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0)
    model = build_model(hf_dir, parallel, moe_options=MoEOptions(aux_loss_coeff=AUX_COEFF))
    optimizer = make_optimizer(model, **{**OPTIM, "clip_grad": 0.0})
    stats = train_step(
        model, optimizer, [batch.rows(0, 2), batch.rows(2, 4)], pg_loss, int(batch.loss_mask.sum()), TEMPERATURE
    )
    destroy_distributed()
    return stats["grad_norm"]


def _hf_grad_norm(hf_dir, batch, micro_batches: tuple[slice, ...]) -> float:
    """Gradient norm of Megatron's per-token objective, built on HF: the policy loss over the global token
    count ``N`` plus, per micro-batch ``m`` of ``T_m`` tokens and per layer, ``coeff * aux * T_m / N`` (Megatron
    weighs each micro-batch's aux loss by its tokens and divides every gradient by ``N``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    experts, k = model.config.num_experts, model.config.num_experts_per_tok
    num_global_tokens = batch.loss_mask.sum()
    total = 0.0
    for rows in micro_batches:
        tokens = batch.tokens[rows]
        out = model(tokens, output_router_logits=True)
        logprobs = torch.log_softmax(out.logits[:, :-1] / TEMPERATURE, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        total = total + -(logprobs * batch.advantages[rows] * batch.loss_mask[rows]).sum() / num_global_tokens
        count = tokens.numel()
        for logits in out.router_logits:
            probs = logits.softmax(-1)
            hits = torch.zeros(experts).index_add_(0, probs.topk(k).indices.flatten(), torch.ones(k * count))
            aux = experts / (k * count**2) * (probs.sum(0) * hits).sum()
            total = total + AUX_COEFF * aux * count / num_global_tokens
    total.backward()
    norms = [p.grad.norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def test_aux_loss_gradient_has_megatron_per_token_scale(tiny_moe_dir, batch):
    got = run_distributed(_grad_norm_worker, 1, str(tiny_moe_dir), batch)
    want = _hf_grad_norm(tiny_moe_dir, batch, (slice(0, 2), slice(2, 4)))
    assert got == pytest.approx(want, rel=1e-5)
