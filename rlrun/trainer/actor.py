"""The actor: this rank's policy model, what it computes before training, how it trains, what the engine gets.

Per step (rlrun/trainer/loop.py calls these in this order; every call runs on every rank in lockstep, the
DP sums are collectives):

    prepare(batch, step)  critic values (PPO, rlrun/trainer/critic.py) -> old-policy / reference / teacher
                          log-probs (role weights swapped in, rlrun/trainer/roles.py) -> per-token advantages
                          and returns (rlrun.algo.rank_advantages) -> the ``rollout_data_postprocess`` hook
    train(batch, step)    per epoch and update: the critic's value-loss step first, then one optimizer step
                          with the configured loss (rlrun.algo.objective); role backups refreshed after
    export_weights()      HF-named tensors for the engine (rlrun.megatron.export)
    save / restore        the model, optimizer and LR schedule (and the critic) through the Checkpointer

Logged as ``train/*`` (defined in docs/metrics.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlrun.algo.aggregate import StepCounts
from rlrun.algo.objective import Objective
from rlrun.algo.rank_advantages import assign_advantages
from rlrun.algo.validate import load_algorithm_hook
from rlrun.data.batch import MicroBatch
from rlrun.trainer.batch import TrainBatch, Update
from rlrun.trainer.critic import Critic
from rlrun.trainer.roles import ModelRoles

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rlrun.config.schema import AlgorithmConfig, RunConfig
    from rlrun.data.source import PromptSource
    from rlrun.megatron.model import MegatronModel
    from rlrun.runtime.dist import Parallel
    from rlrun.trainer.checkpoint import Checkpointer, RunState
    from rlrun.trainer.offload import Offloader

PostprocessHook = Callable[["AlgorithmConfig", int, list[MicroBatch]], None]
"""``algorithm.rollout_data_postprocess``: ``fn(cfg, step, micro_batches)``, may edit the micro-batches."""


def dp_sum(parallel: Parallel, tensor: torch.Tensor) -> torch.Tensor:
    """Sum a small CPU tensor over data-parallel replicas. TP and PP peers hold copies of the same
    micro-batches, so only the rank at TP 0 and PP stage 0 of each replica contributes; every rank gets
    the result (gloo, whatever the device)."""
    replica_head = parallel.tp_rank == 0 and parallel.pp_rank == 0
    total = tensor.detach().clone().float() if replica_head else torch.zeros_like(tensor, dtype=torch.float32)
    dist.all_reduce(total, group=parallel.cpu_group)
    return total


@dataclass(frozen=True)
class TrainerHooks:
    """The trainer's user functions, resolved once at setup (their paths were checked at config load)."""

    postprocess: PostprocessHook | None

    @classmethod
    def load(cls, cfg: AlgorithmConfig) -> TrainerHooks:
        return cls(postprocess=load_algorithm_hook(cfg, "rollout_data_postprocess"))


@dataclass
class Actor:
    """This rank's policy: settings, then the model and how it learns (built once, checkpointed), then what
    rides along (role weights, the critic, user hooks)."""

    cfg: RunConfig
    parallel: Parallel
    model: MegatronModel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler  # the actor's LR schedule: one step per update
    roles: ModelRoles
    critic: Critic | None  # PPO's value model, on the same ranks
    hooks: TrainerHooks

    @classmethod
    def build(cls, cfg: RunConfig, parallel: Parallel, offloader: Offloader) -> Actor:
        """Model, optimizer and schedule (and the critic's) inside the offloader's trainer region, so their
        state can sleep (the gradient buffers in its scratch region: they need no copy); then the role weights
        (CPU backups) and the hooks."""
        from rlrun.megatron import build_model, make_optimizer_and_scheduler
        from rlrun.megatron.moe import MoEOptions
        from rlrun.megatron.recompute import Recompute

        opt = cfg.optimizer
        with offloader.trainer_region():
            model = build_model(
                cfg.model.path,
                parallel,
                dtype=cfg.model.dtype,
                distributed_optimizer=opt.use_distributed_optimizer,
                moe_options=MoEOptions(**cfg.model.moe.model_dump()),
                packed_attention=cfg.model.packed_attention,
                lora=cfg.model.lora,
                seed=cfg.train.seed,
                recompute=Recompute(cfg.train.recompute, cfg.train.recompute_num_layers),
                lm_head=cfg.model.lm_head,
                grad_buffer_region=offloader.scratch_region,
            )
        with offloader.optimizer_region(opt.cpu_offload):
            optimizer, scheduler = make_optimizer_and_scheduler(
                model, opt, cfg.train.num_steps * cfg.train.updates_per_step
            )
        offloader.offload_optimizer_state(optimizer, model.ddp.parameters())
        critic = Critic.build(cfg, parallel, offloader)
        roles = ModelRoles.create(cfg.algorithm, model, num_optimizer_steps=cfg.train.updates_per_step)
        return cls(cfg, parallel, model, optimizer, scheduler, roles, critic, TrainerHooks.load(cfg.algorithm))

    def prepare(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """Once over the whole rollout, before the first update: the critic's values (in-process, no copy
        between models), the role log-probs, the group scores replaced by per-token advantages and returns,
        then the post-process hook. Returns the advantage step's metrics."""
        micro_batches = batch.micro_batches
        if self.critic is not None:
            self.critic.fill_values(micro_batches)
        self.roles.fill_logprobs(micro_batches, self.cfg.rollout.temperature)
        metrics = assign_advantages(self.cfg.algorithm, micro_batches, self._dp_sum)
        if self.hooks.postprocess is not None:
            self.hooks.postprocess(self.cfg.algorithm, step, micro_batches)
        return metrics

    def train(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """Per epoch and update: the critic's value-loss step first (PPO), then one actor step over the
        update's micro-batches (skipped during ``critic.num_critic_only_steps``); the role backups follow the
        actor after the last update. Metrics as :func:`combine_update_metrics` combines them."""
        critic, trains = self.critic, self.trains(step)
        per_update = []
        for _ in range(self.cfg.train.epochs_per_rollout):
            for update in batch.updates:
                metrics = critic.train(update.micro_batches, update.num_global_tokens) if critic is not None else {}
                if trains:
                    metrics.update(self._update(update))
                per_update.append(metrics)
        if trains:
            self.roles.after_train_step(step)
            # The gate reads the first update: later ones have moved the weights off the old policy on purpose.
            check_on_policy(self.cfg.algorithm.max_logprob_gap, step, per_update[0])
        return combine_update_metrics(per_update, len(batch.updates))

    def trains(self, step: int) -> bool:
        """Whether the actor updates at ``step`` (not during the critic's warm-up steps)."""
        return self.critic is None or self.critic.actor_trains(step)

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: the full HF-named tensors, one at a time (the engine's weight sync): views of the live weights
        where no gather is needed, valid until the next update, so a caller that keeps them copies them."""
        from rlrun.megatron import export_hf_weights

        return export_hf_weights(self.model, fresh=False)

    def save(
        self,
        checkpointer: Checkpointer,
        run_state: RunState,
        sampler: PromptSource | None,
        blocking: bool,
        carry: list | None = None,
    ) -> None:
        """Collective: checkpoint the actor (and critic) with ``run_state``, rank 0's sampler cursor and its
        partial-rollout carry (``RolloutRuntime.carry_state``)."""
        checkpointer.save(
            run_state,
            self.model,
            self.optimizer,
            sampler,
            blocking=blocking,
            scheduler=self.scheduler,
            critic=self.critic,
            carry=carry,
        )

    def on_weights_synced(self) -> None:
        """The engine now holds the actor's weights (see ``ModelRoles.on_weights_synced``)."""
        self.roles.on_weights_synced()

    def restore(self, checkpointer: Checkpointer, sampler: PromptSource | None) -> dict[str, int] | None:
        """Collective: load what ``checkpoint.resume`` / ``checkpoint.load`` pick; returns the saved run state
        fields (None: a fresh start). The caller syncs the restored weights to the engine next."""
        resumed = checkpointer.restore(
            self.model, self.optimizer, sampler, critic=self.critic, scheduler=self.scheduler
        )
        return resumed

    def _update(self, update: Update) -> dict[str, float]:
        """One optimizer step with the configured loss over one update's micro-batches; its metrics, the LR
        it stepped with first."""
        from rlrun.megatron import train_step

        metrics: dict[str, float] = {"lr": self.scheduler.get_lr(self.optimizer.param_groups[0])}
        counts = StepCounts(
            num_tokens=update.num_global_tokens,
            num_samples=update.num_global_samples,
            max_response_len=self.cfg.rollout.max_new_tokens,
        )
        with self.roles.training_forward(update.micro_batches):  # MoE routing replay, when configured
            out = train_step(
                self.model,
                self.optimizer,
                update.micro_batches,
                Objective(self.cfg.algorithm, counts),
                num_global_tokens=update.num_global_tokens,
                temperature=self.cfg.rollout.temperature,
                with_entropy=True,
            )
        self.scheduler.step(1)
        metrics.update(train_metrics(out, update.num_global_tokens, self.roles.reuse_logprobs))
        return metrics

    def _dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return dp_sum(self.parallel, tensor)


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


def train_metrics(out: dict[str, float], num_global_tokens: int, reused_logprobs: bool) -> dict[str, float]:
    """``train/*`` of one update from ``train_step``'s sums: token means, except the MoE figures (already
    means), the loss and the gradient norm."""
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
            "train/reused_logprobs": float(reused_logprobs),
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
