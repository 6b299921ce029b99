"""KL estimators, PPO-clip / dual-clip / GSPO / CISPO / SFT terms, and loss aggregation, against
hand-worked values, plain-Python loops and exact KL of small categorical distributions."""

import math

import pytest
import torch

from rlrun.algo.aggregate import Aggregator, StepCounts
from rlrun.algo.kl import kl_estimate
from rlrun.algo.policy_loss import cispo_loss, gspo_log_ratio, gspo_loss, ppo_clip_loss, sft_loss


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([-1.0, -0.5, -3.0]), torch.tensor([-1.5, -0.5, -0.1])
    for (a, b), k1, k2, k3 in zip(
        zip(logp.tolist(), ref.tolist(), strict=False),
        kl_estimate(logp, ref, "k1"),
        kl_estimate(logp, ref, "k2"),
        kl_estimate(logp, ref, "k3"),
        strict=False,
    ):
        d = a - b
        assert k1.item() == pytest.approx(d)
        assert k2.item() == pytest.approx(d * d / 2)
        assert k3.item() == pytest.approx(math.exp(-d) - 1 + d, rel=1e-6)
    # low_var_kl is k3 clamped at 10: a big log-ratio gap exceeds it
    big = kl_estimate(torch.tensor([-20.0]), torch.tensor([-5.0]), "low_var_kl")
    assert big.item() == 10.0 and kl_estimate(torch.tensor([-20.0]), torch.tensor([-5.0]), "k3").item() > 1e6
    ratio = torch.tensor([0.5, 2.0, 1.0])
    assert torch.allclose(kl_estimate(logp, ref, "k3", importance_ratio=ratio), ratio * kl_estimate(logp, ref, "k3"))


def test_k1_and_k3_are_unbiased_estimates_of_exact_kl():
    """Sample tokens from p; the mean of k1 and k3 approaches KL(p || q) = sum p log(p / q)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen), 0)
    q = torch.softmax(torch.randn(6, generator=gen), 0)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist(), strict=False))
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    logp, logq = p.log()[tokens], q.log()[tokens]
    assert kl_estimate(logp, logq, "k1").mean().item() == pytest.approx(exact, rel=0.03)
    assert kl_estimate(logp, logq, "k3").mean().item() == pytest.approx(exact, rel=0.03)
    assert (kl_estimate(logp, logq, "k3") >= 0).all()


def reference_ppo(logp, old, adv, lo, hi, c=None):
    out = []
    for a, o, A in zip(logp, old, adv, strict=False):
        r = math.exp(a - o)
        loss = max(-A * r, -A * min(max(r, 1 - lo), 1 + hi))
        if c is not None and A < 0:
            loss = min(loss, -c * A)
        out.append(loss)
    return out


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.tensor([1.5, 1.5, 0.0, -1.0, 0.3])
    old = torch.zeros(5)
    adv = torch.tensor([-1.0, 1.0, -2.0, -1.0, 0.5])
    terms = ppo_clip_loss(logp, old, adv, 0.2, 0.28, eps_clip_c=3.0)
    assert terms.loss.tolist() == pytest.approx(
        reference_ppo(logp.tolist(), old.tolist(), adv.tolist(), 0.2, 0.28, 3.0)
    )
    # ratio e^1.5 = 4.48 > c with A = -1: loss capped at 3, and the cap has no gradient
    assert terms.loss[0].item() == pytest.approx(3.0)
    lp = logp.clone().requires_grad_(True)
    ppo_clip_loss(lp, old, adv, 0.2, 0.28, eps_clip_c=3.0).loss.sum().backward()
    assert lp.grad[0] == 0.0 and lp.grad[2] != 0.0
    with pytest.raises(ValueError, match="eps_clip_c"):
        ppo_clip_loss(logp, old, adv, 0.2, 0.2, eps_clip_c=0.9)


def test_gspo_sequence_ratio_matches_python_loop():
    gen = torch.Generator().manual_seed(1)
    logp, old = -torch.rand(3, 7, generator=gen), -torch.rand(3, 7, generator=gen)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0]], dtype=torch.float)
    adv = torch.tensor([[0.7] * 7, [-1.2] * 7, [0.3] * 7])
    log_ratio = gspo_log_ratio(logp, old, mask)
    terms = gspo_loss(logp, old, adv, mask, 0.1, 0.1)
    for i in range(3):
        idx = [t for t in range(7) if mask[i, t] > 0]
        s = sum(logp[i, t].item() - old[i, t].item() for t in idx) / len(idx)
        assert log_ratio[i].tolist() == pytest.approx([s] * 7, abs=1e-6)
        expected = reference_ppo([s], [0.0], [adv[i, 0].item()], 0.1, 0.1)[0]
        assert terms.loss[i].tolist() == pytest.approx([expected] * 7, abs=1e-6)
    # gradient: every valid token carries the row's loss -A * exp(s), and ds/dlogp_t = 1/|y|, so the
    # masked token-sum of the loss has gradient -A * exp(s) on each valid token and 0 elsewhere
    lp = logp.clone().requires_grad_(True)
    near_old = logp - 0.01  # every ratio is e^0.01, inside the clip range
    (gspo_loss(lp, near_old, adv, mask, 0.5, 0.5).loss * mask).sum().backward()
    for i in range(3):
        valid = mask[i].bool()
        assert lp.grad[i][valid].tolist() == pytest.approx(
            [-adv[i, 0].item() * math.exp(0.01)] * int(valid.sum()), rel=1e-5
        )
        assert lp.grad[i][~valid].abs().sum() == 0


def test_cispo_keeps_gradient_when_clipped():
    logp = torch.tensor([0.0, 1.0, -1.0], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    terms = cispo_loss(logp, old, adv, eps_clip=1.0, eps_clip_high=0.28)
    weights = [min(max(math.exp(v), 0.0), 1.28) for v in (0.0, 1.0, -1.0)]
    assert terms.loss.tolist() == pytest.approx(
        [-w * a * l for w, a, l in zip(weights, [1, 1, -1], [0.0, 1.0, -1.0], strict=False)]
    )
    assert terms.clipped.tolist() == [0.0, 1.0, 0.0]
    terms.loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx(
        [-w * a for w, a in zip(weights, [1, 1, -1], strict=False)]
    )  # nonzero when clipped


def test_sft_loss_is_negative_log_likelihood():
    assert torch.equal(sft_loss(torch.tensor([-0.5, -2.0])), torch.tensor([0.5, 2.0]))


def test_aggregations_match_python_and_do_not_depend_on_micro_batch_split():
    gen = torch.Generator().manual_seed(2)
    lengths = [3, 1, 6, 2]
    mask = torch.zeros(4, 8)
    for i, n in enumerate(lengths):
        mask[i, 1 : 1 + n] = 1
    x = torch.randn(4, 8, generator=gen)
    counts = StepCounts(num_tokens=sum(lengths), num_samples=4, max_response_len=8)
    per_sample = [sum(x[i, 1 + j].item() for j in range(n)) for i, n in enumerate(lengths)]
    expected = {
        "token": sum(per_sample) / sum(lengths),
        "sample": sum(s / n for s, n in zip(per_sample, lengths, strict=False)) / 4,
        "sequence": sum(s / 8 for s in per_sample) / 4,
    }
    for mode, value in expected.items():
        whole = Aggregator(mask, mode, counts)(x) / counts.num_tokens
        split = (
            sum(Aggregator(mask[a:b], mode, counts)(x[a:b]) for a, b in ((0, 1), (1, 3), (3, 4))) / counts.num_tokens
        )
        assert whole.item() == pytest.approx(value, abs=1e-6)
        assert split.item() == pytest.approx(value, abs=1e-6)
    assert Aggregator(mask, "sample", counts).token_sum(x).item() == pytest.approx(sum(per_sample), abs=1e-5)
