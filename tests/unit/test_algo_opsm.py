"""OPSM (``algorithm.policy_loss: {name: opsm, delta: ...}``): the mask against a plain-Python reference of
DeepSeek-V3.2's rule, cases where it must not mask, packed rows and the objective's metric."""

import math

import pytest
import torch

from rlrun.algo import specs
from rlrun.algo.aggregate import StepCounts
from rlrun.algo.entries import PolicyInputs
from rlrun.algo.losses import opsm
from rlrun.algo.objective import Objective
from rlrun.algo.policy_loss import ppo_clip_loss
from rlrun.config.schema import AlgorithmConfig
from rlrun.data.batch import MicroBatch


def reference_keep(rollout: list[float], current: list[float], advantage: float, delta: float) -> float:
    """1.0 unless the advantage is negative and mean(log pi_rollout - log pi) over the sequence exceeds delta."""
    kl = sum(r - c for r, c in zip(rollout, current, strict=True)) / len(rollout)
    return 0.0 if advantage < 0 and kl > delta else 1.0


def three_samples():
    """Rows: a stale failure (masked), a fresh failure (kept), a stale success (kept); one padded position."""
    logp = torch.tensor([[-1.0, -1.2, -0.8, 0.0], [-0.5, -0.6, -0.7, 0.0], [-2.0, -1.5, -1.0, 0.0]])
    rollout = logp + torch.tensor([[0.3, 0.1, 0.2, 5.0], [1e-5, -1e-5, 2e-5, 5.0], [0.4, 0.4, 0.4, 5.0]])
    old = logp + 0.05
    advantages = torch.tensor([[-1.0] * 4, [-0.5] * 4, [2.0] * 4])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    return logp, old, rollout, advantages, mask


def test_the_mask_matches_the_reference_rule():
    logp, old, rollout, advantages, mask = three_samples()
    settings = opsm.Settings(delta=1e-3)
    terms = opsm.terms(settings, PolicyInputs(logp, old, rollout, advantages, mask, None))
    clip = ppo_clip_loss(logp, old, advantages, settings.eps_clip, settings.clip_high)
    for i in range(3):
        n = int(mask[i].sum())
        keep = reference_keep(rollout[i, :n].tolist(), logp[i, :n].tolist(), advantages[i, 0].item(), 1e-3)
        assert terms.extra["opsm_masked"][i, :n].tolist() == [1.0 - keep] * n
        assert torch.equal(terms.loss[i, :n], clip.loss[i, :n] * keep)
    assert [
        reference_keep(rollout[i, :3].tolist(), logp[i, :3].tolist(), advantages[i, 0].item(), 1e-3) for i in range(3)
    ] == [0.0, 1.0, 1.0]  # the case has one of each outcome
    assert math.isclose(
        opsm.sequence_kl(PolicyInputs(logp, old, rollout, advantages, mask, None))[0, 0].item(), 0.2, rel_tol=1e-6
    )  # the padded position's large gap is outside the mask


def test_on_policy_it_is_ppo_clip_exactly():
    logp, old, _, advantages, mask = three_samples()
    terms = opsm.terms(opsm.Settings(), PolicyInputs(logp, old, logp.clone(), advantages, mask, None))
    assert torch.equal(terms.loss, ppo_clip_loss(logp, old, advantages, 0.2, 0.2).loss)
    assert terms.extra["opsm_masked"].sum() == 0
    big_delta = opsm.terms(opsm.Settings(delta=10.0), PolicyInputs(*three_samples(), None))
    assert big_delta.extra["opsm_masked"].sum() == 0  # no sequence drifts by 10 nats a token


def test_packed_rows_mask_per_sample():
    logp, old, rollout, advantages, mask = three_samples()
    flat = [t[:, :3].reshape(1, 9) for t in (logp, old, rollout, advantages, mask)]
    ids = torch.arange(3).repeat_interleave(3).unsqueeze(0)
    packed = opsm.terms(opsm.Settings(delta=1e-3), PolicyInputs(*flat, ids))
    rows = opsm.terms(opsm.Settings(delta=1e-3), PolicyInputs(logp, old, rollout, advantages, mask, None))
    assert torch.equal(packed.loss, rows.loss[:, :3].reshape(1, 9))
    assert packed.extra["opsm_masked"].tolist() == [[1.0] * 3 + [0.0] * 6]


def test_configured_by_mapping_and_logged_by_the_objective():
    cfg = AlgorithmConfig(policy_loss={"name": "opsm", "delta": 1e-3}, eps_clip=0.1)
    chosen = specs.policy_loss(cfg)
    assert chosen.entry is opsm.ENTRY and chosen.settings == opsm.Settings(delta=1e-3, eps_clip=0.1)
    logp, old, rollout, advantages, mask = three_samples()
    mb = MicroBatch(
        tokens=torch.zeros(3, 5, dtype=torch.long),
        position_ids=torch.arange(5).expand(3, -1),
        loss_mask=mask,
        advantages=advantages,
        rollout_logprobs=rollout * mask,
        old_logprobs=old,
    )
    objective = Objective(cfg, StepCounts(num_tokens=9, num_samples=3, max_response_len=4))
    loss, metrics = objective(mb, logp.clone().requires_grad_(), torch.zeros_like(logp))
    assert metrics["opsm_masked"].item() == 3.0  # the stale failure's three tokens
    loss.backward()
    with pytest.raises(ValueError, match="must be one of"):
        specs.policy_loss(AlgorithmConfig(policy_loss="opsm2"))
