"""PPO's critic on the actor's ranks: build, values for GAE, one value-loss step, checkpoint state.

Per step (rlrun/trainer/actor.py calls these in this order; slime's actor-critic data flow, without Ray):

    fill_values(mbs)      no-grad forward: mb.values = V(prefix) at every position   -> GAE (actor side)
    train(mbs, tokens)    after advantages: one optimizer step on the clipped value loss against
                          mb.returns, with mb.values as the old values                 (critic first)
    actor_trains(step)    False during ``critic.num_critic_only_steps``: the actor skips its update

The critic has its own model (rlrun/megatron/value_head.py), optimizer and checkpoint shard; its
settings are the actor's with the overrides of ``critic.config`` (rlrun/preflight/critic.py). It shares the
actor's ranks and parallel layout, so the values never leave the process. With ``offload.train`` it sleeps and
wakes with the actor, placed as the actor is (rlrun/trainer/offload.py).

Logged as ``critic/*`` (defined in docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlrun.algo.value_loss import clipped_value_loss
from rlrun.runtime.host_to_device import to_device

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rlrun.config.schema import CriticConfig, RunConfig
    from rlrun.data.batch import MicroBatch
    from rlrun.megatron.model import MegatronModel
    from rlrun.runtime.dist import Parallel
    from rlrun.trainer.offload import Offloader


@dataclass
class Critic:
    """This rank's critic: settings, then the model and its optimizer (built once, checkpointed)."""

    settings: CriticConfig
    model: MegatronModel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler  # the critic's LR schedule (its optimizer settings)

    @classmethod
    def build(cls, cfg: RunConfig, parallel: Parallel, offloader: Offloader) -> Critic | None:
        """The critic of ``cfg.critic.config`` (None when the run has none), placed for ``offloader``'s sleeps as the
        actor is (``Actor.build``)."""
        if not cfg.uses_critic:
            return None
        from rlrun.megatron import make_optimizer_and_scheduler
        from rlrun.megatron.value_head import build_critic_model
        from rlrun.preflight.critic import load_critic_config

        spec = load_critic_config(cfg)
        with offloader.trainer_region():
            model = build_critic_model(
                spec.model.path,
                parallel,
                dtype=spec.model.dtype,
                seed=cfg.train.seed,
                packed_attention=spec.model.packed_attention,
                grad_buffer_region=offloader.scratch_region,
            )
        with offloader.optimizer_region(spec.optimizer.cpu_offload):
            optimizer, scheduler = make_optimizer_and_scheduler(
                model, spec.optimizer, cfg.train.num_steps * cfg.train.updates_per_step
            )
        offloader.offload_optimizer_state(optimizer, model.ddp.parameters())
        return cls(settings=cfg.critic, model=model, optimizer=optimizer, scheduler=scheduler)

    def actor_trains(self, step: int) -> bool:
        return step >= self.settings.num_critic_only_steps

    def fill_values(self, micro_batches: list[MicroBatch]) -> None:
        """Set every micro-batch's ``values`` ([B, S-1], CPU float32, zero outside the loss mask)."""
        from rlrun.megatron.value_head import compute_values

        with torch.no_grad():
            for mb in micro_batches:
                mb.values = compute_values(self.model, mb.tokens, mb.position_ids).cpu() * mb.loss_mask

    def train(self, micro_batches: list[MicroBatch], num_global_tokens: int) -> dict[str, float]:
        """One optimizer step on the clipped value loss (needs ``values`` and ``returns`` filled)."""
        from rlrun.megatron.value_head import value_train_step

        for mb in micro_batches:
            if mb.values is None or mb.returns is None:
                raise RuntimeError(
                    "critic training needs mb.values and mb.returns: call fill_values, then the "
                    "advantage step, before Critic.train"
                )
        clip = self.settings.value_clip

        def loss_fn(mb: MicroBatch, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            assert mb.values is not None and mb.returns is not None  # checked above
            device = values.device
            mask, old, returns = (to_device(t, device) for t in (mb.loss_mask, mb.values, mb.returns))
            terms = clipped_value_loss(values, old, returns, mask, clip)
            loss = terms.loss.sum()
            return loss, {
                "value_loss": loss.detach(),
                "value_clip_frac": terms.clipped.sum(),
                "values_mean": (old * mask).sum(),
                "returns_mean": (returns * mask).sum(),
            }

        lr = self.scheduler.get_lr(self.optimizer.param_groups[0])
        out = value_train_step(self.model, self.optimizer, micro_batches, loss_fn, num_global_tokens)
        self.scheduler.step(1)
        metrics = {
            f"critic/{name}": value / num_global_tokens
            for name, value in out.items()
            if name not in ("loss", "grad_norm")
        }
        metrics["critic/grad_norm"] = out["grad_norm"]
        metrics["critic/lr"] = lr
        return metrics

    def checkpoint_state(self) -> dict[str, Any]:
        """The critic's sharded model, optimizer and scheduler state (rlrun/megatron/checkpoint.py)."""
        from rlrun.megatron.checkpoint import training_state

        return training_state(self.model, self.optimizer, self.scheduler, with_rng=False)

    def load_checkpoint(self, directory: Path) -> None:
        """Collective: restore what :meth:`checkpoint_state` saved into ``directory``."""
        from rlrun.megatron.checkpoint import load

        load(self.model, self.optimizer, self.scheduler, directory, with_rng=False)
