"""The training loss of one micro-batch, assembled from the configured terms:

    loss = agg(w_tis * policy_term) - entropy_coef * agg(entropy) + kl.loss_coef * agg(kl(logp, logp_ref))

``policy_term`` is ``algorithm.policy_loss`` with its settings (default: the estimator's; chosen by
``rlrun.algo.specs``, the losses are ``rlrun.algo.losses``);
``loss_type: sft`` replaces the whole loss with ``agg(-logp)`` and ``custom`` with the user's function.
``agg`` is the configured aggregation (rlrun/algo/aggregate.py). Metrics are masked *sums*; dividing
them by the step's token count gives token means (and, for the aggregated terms, the configured mean).

When the micro-batch has no ``old_logprobs`` (the reuse path, see ``rlrun.trainer.roles``), the old policy is
this forward's own log-probs, detached: the same numbers the no-grad forward would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlrun.algo import specs
from rlrun.algo.aggregate import Aggregator, StepCounts
from rlrun.algo.entries import PolicyInputs
from rlrun.algo.kl import kl_estimate
from rlrun.algo.mismatch import mismatch_terms, tis_weights
from rlrun.algo.policy_loss import PolicyLossTerms, sft_loss
from rlrun.algo.validate import CUSTOM_LOSS_SIGNATURE, load_algorithm_hook
from rlrun.runtime.host_to_device import to_device

if TYPE_CHECKING:
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.data.batch import MicroBatch

Metrics = dict[str, torch.Tensor]


@dataclass
class Objective:
    """Callable as ``objective(mb, logprobs, entropy) -> (loss_sum, metrics)`` for ``train_step``."""

    cfg: AlgorithmConfig
    counts: StepCounts

    def __post_init__(self) -> None:
        self.custom_loss = load_algorithm_hook(self.cfg, "custom_loss")
        self.policy_loss = specs.policy_loss(self.cfg) if self.cfg.loss_type == "policy" else None

    def __call__(self, mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        device = logprobs.device
        mask = to_device(mb.loss_mask, device)
        agg = Aggregator(mask, self.cfg.loss_aggregation, self.counts, mb.sample_ids)
        if self.cfg.loss_type == "sft":
            loss = agg(sft_loss(logprobs))
            return loss, {"sft_loss": loss.detach(), "entropy": agg.token_sum(entropy.detach())}
        if self.cfg.loss_type == "custom":
            return self._custom(mb, logprobs, entropy, agg)
        return self._policy(mb, logprobs, entropy, agg)

    def _policy(
        self, mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor, agg: Aggregator
    ) -> tuple[torch.Tensor, Metrics]:
        cfg, device = self.cfg, logprobs.device
        rollout = to_device(mb.rollout_logprobs, device)
        trainer_old = to_device(mb.old_logprobs, device) if mb.old_logprobs is not None else logprobs.detach()
        old = rollout if cfg.use_rollout_logprobs else trainer_old
        advantages = to_device(mb.advantages, device)
        inputs = PolicyInputs(logprobs, old, rollout, advantages, agg.mask, agg.sample_ids)
        assert self.policy_loss is not None  # chosen whenever loss_type is policy, the only caller
        terms = self.policy_loss.entry.terms(self.policy_loss.settings, inputs)
        per_token = terms.loss
        metrics: Metrics = {}
        if cfg.tis.mode != "off":
            tis = tis_weights(
                trainer_old,
                rollout,
                agg.mask,
                cfg.tis.mode,
                cfg.tis.level,
                cfg.tis.clip,
                cfg.tis.clip_low,
                agg.sample_ids,
            )
            per_token = per_token * tis.weights
            metrics.update(tis_mean=agg.token_sum(tis.raw), tis_clip_frac=agg.token_sum(tis.bounded))
        policy_loss = agg(per_token)
        entropy_term = agg(entropy if cfg.entropy_coef > 0 else entropy.detach())
        loss = policy_loss - cfg.entropy_coef * entropy_term if cfg.entropy_coef > 0 else policy_loss
        if mb.ref_logprobs is not None:
            ratio = torch.exp(logprobs - old) if cfg.kl.unbiased else None
            kl = kl_estimate(logprobs, to_device(mb.ref_logprobs, device), cfg.kl.estimator, importance_ratio=ratio)
            if cfg.kl.loss_coef > 0:
                kl_loss = agg(kl)
                loss = loss + cfg.kl.loss_coef * kl_loss
                metrics["kl_loss"] = kl_loss.detach()
            metrics["kl_ref"] = agg.token_sum(kl.detach())
        metrics.update({name: agg.token_sum(value) for name, value in mismatch_terms(trainer_old, rollout).items()})
        metrics.update(
            policy_loss=policy_loss.detach(),
            entropy=entropy_term.detach(),
            clip_frac=agg.token_sum(terms.clipped),
            approx_kl=agg.token_sum(terms.approx_kl.detach()),
            abs_log_ratio=agg.token_sum((logprobs.detach() - old).abs()),
        )
        metrics.update({name: agg.token_sum(value.detach()) for name, value in terms.extra.items()})
        return loss, metrics

    def _custom(
        self, mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor, agg: Aggregator
    ) -> tuple[torch.Tensor, Metrics]:
        result = self.custom_loss(self.cfg, mb, logprobs, entropy, agg)
        if not (
            isinstance(result, tuple)
            and len(result) == 2
            and isinstance(result[0], torch.Tensor)
            and result[0].dim() == 0
            and isinstance(result[1], dict)
        ):
            raise ValueError(
                f"algorithm.custom_loss ('{self.cfg.custom_loss}') must return (loss, metrics): a scalar "
                f"tensor and a dict of scalar tensors, because train_step backpropagates the loss; it "
                f"returned {type(result).__name__}. Expected signature: {CUSTOM_LOSS_SIGNATURE}"
            )
        return result


def policy_terms(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    sample_ids: torch.Tensor | None = None,
    rollout_logprobs: torch.Tensor | None = None,
) -> PolicyLossTerms:
    """The per-token policy term of the configured loss (``sample_ids``: ``rlrun.algo.segments``; the rollout
    log-probs default to the old ones)."""
    chosen = specs.policy_loss(cfg)
    rollout = old_logprobs if rollout_logprobs is None else rollout_logprobs
    inputs = PolicyInputs(logprobs, old_logprobs, rollout, advantages, mask, sample_ids)
    return chosen.entry.terms(chosen.settings, inputs)
