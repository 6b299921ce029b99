"""Long-response memory options change no number: activation recompute (none / selective / full, all layers or
the first N) and the chunked LM head (``model.lm_head``) against Megatron's output layer, fp32, on real
Megatron ranks (gloo): the same loss, entropy, grad norm and every parameter's gradient, at TP=1 (tied and
untied heads) and TP=2. The chunk size is shrunk so that every row spans several chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dist_utils import run_distributed

TEMPERATURE = 0.8
VARIANTS = (
    ("logits", "none", None),  # the reference: Megatron's output layer, every activation kept
    ("chunked", "none", None),
    ("chunked_kept", "none", None),
    ("chunked", "selective", None),
    ("chunked", "full", None),
    ("logits", "full", 1),
)
pytestmark = pytest.mark.slow


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor


def _batches(vocab_size: int, packed_row: bool = True) -> list[MicroBatch]:
    """Two rows of 13 tokens, then (``packed_row``) one packed row of samples of 7 and 9 tokens (the ``thd`` path)."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, vocab_size, (2, 13), generator=gen)
    packed = torch.randint(0, vocab_size, (1, 16), generator=gen)
    packed_pos = torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0)
    out = []
    layouts = ((rows, torch.arange(13).expand(2, 13)), (packed, packed_pos))
    for tokens, pos in layouts if packed_row else layouts[:1]:
        mask = (torch.rand(tokens.shape[0], tokens.shape[1] - 1, generator=gen) < 0.8).float()
        out.append(MicroBatch(tokens, pos, mask, torch.randn(mask.shape, generator=gen)))
    return out


def _loss(batch: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
    mask, adv = (t.to(logprobs.device) for t in (batch.loss_mask, batch.advantages))
    loss_sum = -((logprobs * adv - 0.1 * entropy) * mask).sum()
    return loss_sum, {"entropy_sum": (entropy * mask).sum().detach()}


def _worker(jobs: list[tuple], tp: int, cp: int = 1) -> dict:
    """Per job ``(hf_dir, lm_head, recompute, recompute_num_layers, packed_row)``: a fresh model, no-grad log-probs
    and entropy, one train step (no clipping, so the gradient buffers hold the raw gradients); its stats, every
    parameter's gradient and the updated weights. ``cp``: context-parallel size (unpacked rows only)."""
    from rlrun.megatron import (
        build_model,
        compute_logprobs,
        compute_logprobs_and_entropy,
        make_optimizer,
        token_stats,
        train_step,
    )
    from rlrun.megatron.hf_config import ModelArch
    from rlrun.megatron.recompute import Recompute
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    token_stats.CHUNK_BYTES = 4 * 200 * 5  # ~5 tokens per chunk of a 200-id vocabulary slice: several per row
    parallel = init_distributed(tp=tp, pp=1, seed=0, cp=cp)
    results = {}
    for job in jobs:
        hf_dir, lm_head, mode, layers, packed_row = job
        batches = _batches(ModelArch.from_hf_dir(hf_dir).vocab_size, packed_row)
        tokens = int(sum(b.loss_mask.sum() for b in batches))
        model = build_model(hf_dir, parallel, "float32", recompute=Recompute(mode, layers), lm_head=lm_head)
        assert model.deferred_head == (lm_head != "logits")
        assert model.keeps_head_logits == (lm_head == "chunked_kept")
        last = batches[-1]
        with torch.no_grad():
            scored = compute_logprobs_and_entropy(model, last.tokens, last.position_ids, TEMPERATURE)
            # top-p mask replay: log-probs renormalised over kept sets (the targets among them), -1 padded
            kept = torch.randint(0, 40, (*last.loss_mask.shape, 4), generator=torch.Generator().manual_seed(5))
            kept[..., 0], kept[..., 3] = last.tokens[:, 1:], -1
            scored = (*scored, compute_logprobs(model, last.tokens, last.position_ids, TEMPERATURE, kept))
        # eps 1e-4: Adam's first step is ~lr * sign(g) for |g| << eps no longer, so rounding-level gradient
        # differences (1e-9) cannot flip a weight's update; the gradients themselves are compared at 1e-6.
        optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-4, clip_grad=0.0)
        calls = []  # core-attention forwards of the train step: recompute runs them again in the backward
        for layer in model.module.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(lambda *_: calls.append(1))
        stats = train_step(model, optimizer, batches, _loss, tokens, TEMPERATURE, with_entropy=True)
        results[job] = {
            "stats": stats,
            "grads": {name: p.main_grad.detach().clone() for name, p in model.module.named_parameters()},
            "scored": scored,
            "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items() if "_extra" not in k},
            "attention_calls_per_layer_and_batch": len(calls) / len(model.module.decoder.layers) / len(batches),
        }
    destroy_distributed()
    return results


def _assert_same(got: dict, want: dict) -> None:
    for key, value in want["stats"].items():
        assert got["stats"][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    for got_t, want_t in zip(got["scored"], want["scored"], strict=True):
        torch.testing.assert_close(got_t, want_t, rtol=0, atol=1e-6)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-6, msg=name)


CP_VARIANTS = (VARIANTS[0], VARIANTS[4])


def _jobs(hf_dirs, variants, packed_row: bool = True) -> list[tuple]:
    return [(hf_dir, *variant, packed_row) for hf_dir in hf_dirs for variant in variants]


@pytest.fixture(scope="module")
def dirs(tiny_model_dirs) -> list[str]:
    return [str(tiny_model_dirs["qwen3"]), str(tiny_model_dirs["llama"])]  # untied head; tied embeddings


@pytest.fixture(scope="module")
def single_rank(dirs) -> dict:
    """One process for every TP=1, CP=1 reference: all variants on rows + a packed row, and the CP references."""
    return run_distributed(_worker, 1, _jobs(dirs, VARIANTS) + _jobs(dirs[:1], CP_VARIANTS, False), 1)


def test_recompute_and_chunked_head_match_the_plain_step(dirs, single_rank):
    for hf_dir in dirs:
        want = single_rank[(hf_dir, *VARIANTS[0], True)]
        assert max(g.abs().max() for g in want["grads"].values()) > 1e-3  # gradients that can differ
        for variant in VARIANTS[1:]:
            _assert_same(single_rank[(hf_dir, *variant, True)], want)
        calls = [single_rank[(hf_dir, *v, True)]["attention_calls_per_layer_and_batch"] for v in VARIANTS]
        # once per layer without recompute; twice with selective and full (every layer, or the first N = 1 of 2)
        assert calls == [1, 1, 1, 2, 2, 1.5]


def test_chunked_head_matches_at_tp2(dirs):
    """Vocab-parallel: each TP rank projects its vocabulary slice (keeping its logits or not); the hidden-state
    gradient is all-reduced."""
    jobs = _jobs(dirs[1:], (VARIANTS[0], VARIANTS[2], VARIANTS[3]))
    for rank in run_distributed(_worker, 2, jobs, 2, all_ranks=True):
        for job in jobs[1:]:
            _assert_same(rank[job], rank[jobs[0]])


def test_context_parallel_cp2_matches_cp1(dirs, single_rank):
    """CP=2 (each rank holds two of four chunks of every row, keys/values all-gathered, rows of 13 tokens padded
    to 16) against CP=1: the same loss, entropy, grad norm, no-grad log-probs, gradients and updated weights on
    both ranks, with Megatron's LM head and with the chunked one under full recompute."""
    jobs = _jobs(dirs[:1], CP_VARIANTS, False)
    for rank in run_distributed(_worker, 2, jobs, 1, 2, all_ranks=True):
        for job in jobs:
            want = single_rank[job]
            _assert_same(rank[job], want)
            for name, tensor in want["weights"].items():
                torch.testing.assert_close(rank[job]["weights"][name], tensor, rtol=0, atol=1e-6, msg=name)
