"""The assembled micro-batch loss against a plain-Python composition of its terms, the reuse path
(no old log-probs) against the full path, SFT and custom losses."""

import math

import pytest
import torch

from rlrun.algo.aggregate import StepCounts
from rlrun.algo.objective import Objective
from rlrun.config.schema import AlgorithmConfig
from rlrun.data.batch import MicroBatch

LENGTHS = [(1, 4), (2, 2), (0, 6)]  # (prompt positions, response positions) per row: ragged
WIDTH = 7


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(LENGTHS), WIDTH)
    adv = torch.zeros(len(LENGTHS), WIDTH)
    for i, (p, r) in enumerate(LENGTHS):
        mask[i, p : p + r] = 1
        adv[i, p : p + r] = float(torch.randn(1, generator=gen))
    logprobs = -torch.rand(mask.shape, generator=gen) * 2
    mb = MicroBatch(
        tokens=torch.zeros(len(LENGTHS), WIDTH + 1, dtype=torch.long),
        position_ids=torch.arange(WIDTH + 1).expand(len(LENGTHS), -1),
        loss_mask=mask,
        advantages=adv,
        rollout_logprobs=(logprobs + 0.3 * torch.randn(mask.shape, generator=gen)) * mask,
        old_logprobs=logprobs + 0.2 * torch.randn(mask.shape, generator=gen),
        ref_logprobs=logprobs + 0.5 * torch.randn(mask.shape, generator=gen),
    )
    entropy = torch.rand(mask.shape, generator=gen) * 3
    return mb, logprobs, entropy


def counts_of(mb):
    return StepCounts(num_tokens=int(mb.loss_mask.sum()), num_samples=len(LENGTHS), max_response_len=6)


def valid_tokens():
    return [(i, t) for i, (p, r) in enumerate(LENGTHS) for t in range(p, p + r)]


def test_policy_loss_matches_python_composition():
    cfg = AlgorithmConfig(
        eps_clip=0.2,
        eps_clip_high=0.28,
        eps_clip_c=3.0,
        entropy_coef=0.01,
        kl={"loss_coef": 0.05, "estimator": "k3"},
        tis={"mode": "clip", "clip": 2.0},
    )
    mb, logprobs, entropy = make_batch()
    loss_sum, metrics = Objective(cfg, counts_of(mb))(mb, logprobs, entropy)
    n = len(valid_tokens())
    pg = ent = kl = clipped = 0.0
    for i, t in valid_tokens():
        lp, old, a = logprobs[i, t].item(), mb.old_logprobs[i, t].item(), mb.advantages[i, t].item()
        ratio = math.exp(lp - old)
        term = max(-a * ratio, -a * min(max(ratio, 0.8), 1.28))
        clipped += float(-a * min(max(ratio, 0.8), 1.28) > -a * ratio)
        if a < 0:
            term = min(term, -3.0 * a)
        weight = min(max(math.exp(old - mb.rollout_logprobs[i, t].item()), 0.0), 2.0)
        pg += term * weight
        ent += entropy[i, t].item()
        d = mb.ref_logprobs[i, t].item() - lp
        kl += math.exp(d) - 1 - d
    expected = pg / n - 0.01 * ent / n + 0.05 * kl / n
    assert loss_sum.item() / n == pytest.approx(expected, rel=1e-5)
    assert metrics["policy_loss"].item() / n == pytest.approx(pg / n, rel=1e-5)
    assert metrics["kl_loss"].item() / n == pytest.approx(kl / n, rel=1e-5)
    assert metrics["clip_frac"].item() == clipped
    gap = sum(abs(mb.old_logprobs[i, t].item() - mb.rollout_logprobs[i, t].item()) for i, t in valid_tokens())
    assert metrics["logprob_gap"].item() == pytest.approx(gap, rel=1e-5)


def test_gspo_with_sample_aggregation_matches_python():
    cfg = AlgorithmConfig(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4, loss_aggregation="sample")
    mb, logprobs, entropy = make_batch(seed=1)
    mb.old_logprobs = logprobs + 1e-4 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(9))
    loss_sum, _ = Objective(cfg, counts_of(mb))(mb, logprobs, entropy)
    per_sample = []
    for i, (p, r) in enumerate(LENGTHS):
        s = sum(logprobs[i, t].item() - mb.old_logprobs[i, t].item() for t in range(p, p + r)) / r
        a = mb.advantages[i, p].item()
        ratio = math.exp(s)
        per_sample.append(max(-a * ratio, -a * min(max(ratio, 1 - 3e-4), 1 + 4e-4)))  # same for every token
    expected = sum(per_sample) / len(LENGTHS)  # mean over tokens of a sample = the sample's value
    assert loss_sum.item() / counts_of(mb).num_tokens == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"advantage_estimator": "cispo", "eps_clip": 1.0},
        {"kl": {"loss_coef": 0.1, "estimator": "low_var_kl"}},
        {"tis": {"mode": "mask", "level": "geometric", "clip": 1.2, "clip_low": 0.8}, "loss_aggregation": "sequence"},
    ],
)
def test_reuse_path_gives_identical_loss_and_gradient(overrides):
    """Reuse: no old log-probs, the loss detaches its own. Full: old log-probs from a separate pass
    (here: the same values, as a no-grad forward of unchanged weights produces)."""
    cfg = AlgorithmConfig(**overrides)
    mb, logprobs, entropy = make_batch(seed=2)
    results = []
    for old in (None, logprobs.clone()):
        mb.old_logprobs = old
        lp = logprobs.clone().requires_grad_(True)
        loss, metrics = Objective(cfg, counts_of(mb))(mb, lp, entropy)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (loss_a, grad_a, metrics_a), (loss_b, grad_b, metrics_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert grad_a.abs().sum() > 0
    assert {k: v.item() for k, v in metrics_a.items()} == {k: v.item() for k, v in metrics_b.items()}


def test_sft_loss_and_custom_loss(tmp_path):
    mb, logprobs, entropy = make_batch(seed=3)
    n = counts_of(mb).num_tokens
    loss, metrics = Objective(AlgorithmConfig(loss_type="sft"), counts_of(mb))(mb, logprobs, entropy)
    assert loss.item() / n == pytest.approx(-sum(logprobs[i, t].item() for i, t in valid_tokens()) / n, rel=1e-6)
    hook = tmp_path / "my_loss.py"
    hook.write_text(
        "def loss(cfg, mb, logprobs, entropy, aggregate):\n"
        "    value = aggregate(logprobs ** 2)\n    return value, {'square': value.detach()}\n"
        "def bad(cfg, mb, logprobs, entropy, aggregate):\n    return None\n"
    )
    cfg = AlgorithmConfig(loss_type="custom", custom_loss=f"{hook}:loss")
    loss, metrics = Objective(cfg, counts_of(mb))(mb, logprobs, entropy)
    assert loss.item() / n == pytest.approx(sum(logprobs[i, t].item() ** 2 for i, t in valid_tokens()) / n, rel=1e-6)
    assert set(metrics) == {"square"}
    bad = AlgorithmConfig(loss_type="custom", custom_loss=f"{hook}:bad")
    with pytest.raises(
        ValueError,
        match=r"algorithm.custom_loss \('.*my_loss.py:bad'\) must return \(loss, metrics\).*"
        r"Expected signature: fn\(cfg",
    ):
        Objective(bad, counts_of(mb))(mb, logprobs, entropy)


def test_use_rollout_logprobs_takes_the_engine_as_old_policy():
    cfg = AlgorithmConfig(use_rollout_logprobs=True)
    mb, logprobs, entropy = make_batch(seed=4)
    mb.old_logprobs = None  # no trainer forward: the roles skip it with use_rollout_logprobs
    loss_sum, metrics = Objective(cfg, counts_of(mb))(mb, logprobs, entropy)
    pg = 0.0
    for i, t in valid_tokens():
        ratio = math.exp(logprobs[i, t].item() - mb.rollout_logprobs[i, t].item())
        a = mb.advantages[i, t].item()
        pg += max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
    assert loss_sum.item() == pytest.approx(pg, rel=1e-5)
    gap = sum(abs(logprobs[i, t].item() - mb.rollout_logprobs[i, t].item()) for i, t in valid_tokens())
    assert metrics["logprob_gap"].item() == pytest.approx(gap, rel=1e-5)  # the trainer's own log-probs
