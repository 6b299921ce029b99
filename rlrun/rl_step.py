"""The RL half of a step on one rank: critic values -> role log-probs -> advantages -> post-process hook -> train.

``loop.py`` calls ``logprobs_and_advantages`` then ``train_policy``; everything here runs on every
rank in lockstep (the DP sums are collectives). The math is in ``rlrun.algo``; the weight swapping
in ``rlrun.roles``.

Logged as ``train/*`` (defined in docs/metrics.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlrun.algo.aggregate import StepCounts
from rlrun.algo.objective import Objective
from rlrun.algo.rank_advantages import assign_advantages
from rlrun.algo.validate import load_algorithm_hook

if TYPE_CHECKING:
    from rlrun.config.schema import RunConfig
    from rlrun.critic import Critic
    from rlrun.data.batch import MicroBatch
    from rlrun.roles import ModelRoles
    from rlrun.runtime.dist import Parallel


def dp_sum(parallel: Parallel, tensor: torch.Tensor) -> torch.Tensor:
    """Sum a small CPU tensor over data-parallel replicas. TP and PP peers hold copies of the same
    micro-batches, so only the rank at TP 0 and PP stage 0 of each replica contributes; every rank gets
    the result (gloo, whatever the device)."""
    replica_head = parallel.tp_rank == 0 and parallel.pp_rank == 0
    total = tensor.detach().clone().float() if replica_head else torch.zeros_like(tensor, dtype=torch.float32)
    dist.all_reduce(total, group=parallel.cpu_group)
    return total


def logprobs_and_advantages(
    cfg: RunConfig,
    roles: ModelRoles,
    parallel: Parallel,
    micro_batches: list[MicroBatch],
    step: int,
    critic: Critic | None = None,
) -> dict[str, float]:
    """Fill the critic's values (PPO: in-process, no copy between models) and the role log-probs, replace
    the group scores by per-token advantages and returns, run the post-process hook."""
    if critic is not None:
        critic.fill_values(micro_batches)
    roles.fill_logprobs(micro_batches, cfg.rollout.temperature)
    metrics = assign_advantages(cfg.algorithm, micro_batches, lambda t: dp_sum(parallel, t))
    postprocess = load_algorithm_hook(cfg.algorithm, "rollout_data_postprocess")
    if postprocess is not None:
        postprocess(cfg.algorithm, step, micro_batches)
    return metrics


class OffPolicyError(RuntimeError):
    """The trainer did not score the samples as the engine did (``algorithm.max_logprob_gap``)."""


def check_on_policy(max_gap: float | None, step: int, metrics: dict[str, float]) -> None:
    """The on-policy gate (``algorithm.max_logprob_gap``; None: off). The step's trainer-vs-engine gap must be
    at most ``max_gap``; at step 0, before any update, the training forward must also reproduce the old
    log-probs exactly (ratio 1, KL 0), since both are the trainer's own forwards of the same weights."""
    if max_gap is None or "train/logprob_gap" not in metrics:
        return
    gap = metrics["train/logprob_gap"]
    if not gap <= max_gap:  # also NaN
        raise OffPolicyError(
            f"train/logprob_gap at step {step} ({gap:.3g} nats per token) must be <= algorithm.max_logprob_gap "
            f"({max_gap:g}) because the policy gradient is for the engine's samples: the trainer and the engine "
            "disagree (kernels, dtype, weights out of sync; docs/on_policy.md); fix that, or raise or unset "
            "algorithm.max_logprob_gap to train off-policy"
        )
    log_ratio, kl = metrics.get("train/abs_log_ratio", 0.0), metrics.get("train/approx_kl", 0.0)
    if step == 0 and (log_ratio != 0.0 or kl != 0.0):
        raise OffPolicyError(
            f"at step 0 the policy ratio must be exactly 1 and the old-policy KL exactly 0 (got mean "
            f"|log ratio| {log_ratio:.3g}, approx_kl {kl:.3g}) "
            "because nothing has been updated yet: the old-log-prob and the training forward of the same weights "
            "differ (a non-deterministic kernel, or different packing); unset algorithm.max_logprob_gap to ignore"
        )


def train_policy(
    cfg: RunConfig,
    roles: ModelRoles,
    parallel: Parallel,
    model,
    optimizer,
    micro_batches: list[MicroBatch],
    num_global_tokens: int,
) -> dict[str, float]:
    """One optimizer step with the configured loss over one update's micro-batches."""
    from rlrun.megatron import train_step

    local_samples = torch.tensor(sum(mb.num_loss_samples for mb in micro_batches))  # packed rows: not per row
    counts = StepCounts(
        num_tokens=num_global_tokens,
        num_samples=int(dp_sum(parallel, local_samples).item()),
        max_response_len=cfg.rollout.max_new_tokens,
    )
    with roles.training_forward(micro_batches):  # MoE routing replay, when configured
        out = train_step(
            model,
            optimizer,
            micro_batches,
            Objective(cfg.algorithm, counts),
            num_global_tokens=num_global_tokens,
            temperature=cfg.rollout.temperature,
            with_entropy=True,
        )
    metrics = {
        f"train/{name}": value if name.startswith("moe_") else value / num_global_tokens
        for name, value in out.items()
        if name not in ("loss", "grad_norm")
    }
    metrics.update(
        {
            "train/loss": out["loss"],
            "train/grad_norm": out["grad_norm"],
            "train/num_loss_tokens": num_global_tokens,
            "train/reused_logprobs": float(roles.reuse_logprobs),
        }
    )
    return metrics


def combine_update_metrics(per_update: list[dict[str, float]], updates_per_epoch: int) -> dict[str, float]:
    """A step's metrics from its updates' (epoch-major): with one update, its own; with several, every
    update's under ``<prefix>/update_<k>/<name>`` (``k`` from 0, so a plot shows them within the step; the
    bare ``lr`` under ``train/``) and the step's aggregate under the plain name: the mean over updates, except
    ``train/num_loss_tokens``, the rollout's loss tokens (the sum over one epoch's updates)."""
    if len(per_update) <= 1:
        return per_update[0] if per_update else {}
    combined: dict[str, float] = {}
    for k, metrics in enumerate(per_update):
        for name, value in metrics.items():
            prefix, _, rest = name.rpartition("/") if "/" in name else ("train", "", name)
            combined[f"{prefix}/update_{k}/{rest}"] = value
    for name in per_update[0]:
        values = [m[name] for m in per_update if name in m]
        combined[name] = sum(values) / len(values)
    if "train/num_loss_tokens" in combined:
        combined["train/num_loss_tokens"] = sum(
            m.get("train/num_loss_tokens", 0) for m in per_update[:updates_per_epoch]
        )
    return combined
