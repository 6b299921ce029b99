"""Packed micro-batches: two samples sharing one row give the same per-token log-probs, loss and
gradient as the same samples in micro-batches of their own (real Megatron on CPU, fp32, TP=1 and TP=2).

The reference is the unpacked run: each sample alone in a row with positions 0..S-1, which is the
plain causal path with no packing involved. GSPO with per-sample aggregation and TIS at sequence level
makes the loss depend on per-sample sums, so a row-level reduction would change the numbers.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

TEMPERATURE = 0.7
OPTIM = dict(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-6, clip_grad=1e9)
pytestmark = pytest.mark.slow


def _samples():
    from rlrun.data.sample import Prompt, Sample

    gen = torch.Generator().manual_seed(3)
    samples = []
    for index, (prompt_len, resp_len, reward) in enumerate([(5, 6, 1.0), (3, 9, -0.5)]):
        ids = torch.randint(3, 200, (prompt_len + resp_len,), generator=gen).tolist()
        prompt = Prompt(index=index, prompt_ids=ids[:prompt_len], prompt_text="")
        logprobs = (-torch.rand(resp_len, generator=gen)).tolist()
        samples.append(
            Sample(
                group_index=index,
                prompt=prompt,
                response_ids=ids[prompt_len:],
                response_text="",
                rollout_logprobs=logprobs,
                finish_reason="stop",
                reward=reward,
            )
        )
    return samples


def _run(hf_dir: str, tp: int, layouts: list[list[list[int]]]) -> tuple[list[dict], torch.Tensor]:
    """For each layout (micro-batches as lists of sample indices): per-sample log-probs of the response
    tokens, then one GSPO train step from fresh weights, and the updated weights; and the naive
    concatenation's log-probs."""
    from rlrun.algo.aggregate import StepCounts
    from rlrun.algo.objective import Objective
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.data.batch import collate
    from rlrun.megatron import build_model, compute_logprobs, export_hf_weights, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp=tp, pp=1, seed=0)
    samples = _samples()
    cfg = AlgorithmConfig(
        advantage_estimator="gspo",
        loss_aggregation="sample",
        entropy_coef=0.01,
        tis={"mode": "clip", "level": "sequence", "clip": 1.5, "clip_low": 0.5},
    )
    counts = StepCounts(
        num_tokens=sum(s.num_loss_tokens for s in samples), num_samples=len(samples), max_response_len=16
    )
    results = []
    for layout in layouts:
        model = build_model(hf_dir, parallel, dtype="float32")
        micro_batches = [collate([samples[i] for i in mb], [samples[i].reward for i in mb], 0) for mb in layout]
        per_sample = {}
        with torch.no_grad():
            for mb, indices in zip(micro_batches, layout, strict=False):
                logprobs = compute_logprobs(model, mb.tokens, mb.position_ids, TEMPERATURE).cpu()
                mb.old_logprobs = logprobs + 0.1 * mb.rollout_logprobs  # off-policy by a per-token amount
                for local, index in enumerate(indices):
                    keep = (mb.sample_ids == local) & (mb.loss_mask > 0)
                    per_sample[index] = logprobs[keep]
        optimizer = make_optimizer(model, **OPTIM)
        stats = train_step(
            model, optimizer, micro_batches, Objective(cfg, counts), counts.num_tokens, TEMPERATURE, with_entropy=True
        )
        results.append(
            {"logprobs": per_sample, "stats": stats, "weights": {k: v.cpu() for k, v in export_hf_weights(model)}}
        )
    naive = _naive_concatenation_logprobs(hf_dir, parallel)
    destroy_distributed()
    return results, naive


def _naive_concatenation_logprobs(hf_dir: str, parallel) -> torch.Tensor:
    """The second sample's response log-probs when the row is concatenated without packing (positions
    0..S-1, attention across the boundary): what packing must NOT produce."""
    from rlrun.data.batch import collate
    from rlrun.megatron import build_model, compute_logprobs

    mb = collate(_samples(), [0.0, 0.0], 0)
    model = build_model(hf_dir, parallel, dtype="float32")
    with torch.no_grad():
        plain = torch.arange(mb.tokens.shape[1]).unsqueeze(0)
        logprobs = compute_logprobs(model, mb.tokens, plain, TEMPERATURE).cpu()
    return logprobs[(mb.sample_ids == 1) & (mb.loss_mask > 0)]


@pytest.mark.parametrize("family, tp", [("qwen3", 1), ("llama", 1), ("qwen3", 2)])
def test_packed_equals_separate(tiny_model_dirs, family, tp):
    hf_dir = str(tiny_model_dirs[family])
    (separate, packed), naive = run_distributed(_run, tp, hf_dir, tp, [[[0], [1]], [[0, 1]]])
    for index in (0, 1):
        torch.testing.assert_close(packed["logprobs"][index], separate["logprobs"][index], rtol=0, atol=1e-5)
    for name in ("loss", "grad_norm", "policy_loss", "entropy", "tis_mean", "clip_frac"):
        assert packed["stats"][name] == pytest.approx(separate["stats"][name], rel=1e-5, abs=1e-7), name
    for name, weight in separate["weights"].items():
        torch.testing.assert_close(packed["weights"][name], weight, rtol=0, atol=1e-5)  # 1% of an Adam step
    # the comparison is sensitive: attending across the boundary changes the second sample's log-probs
    assert (naive - separate["logprobs"][1]).abs().max() > 1e-3
