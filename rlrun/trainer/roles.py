"""Model roles on one Megatron model: actor, reference, teacher, old actor (slime's weight-backup scheme).

Only the actor has live weights. The others are CPU backups (``rlrun.megatron.weight_backup``) swapped
in for a no-grad forward pass, then the actor is swapped back before training:

    step:  backup(actor) -> [restore(ref) -> ref_logprobs] -> [restore(teacher) -> teacher_logprobs]
           -> [restore(old_actor | actor) -> old_logprobs] -> restore(actor) -> advantages -> train
           -> after_train_step: ref <- actor every ``ref.update_interval`` steps
           -> on_weights_synced: old_actor <- actor (the weights the engine holds from now on)

With LoRA (``model.lora``) the reference is no copy: it is the same model with its adapters off (the
frozen base weights), and the teacher is scored with the adapters off too. Without a teacher the backups
(the old actor) hold the adapters alone, since every role shares the frozen base.

Where the role weights come from: ``ref.path`` / ``opd.teacher_path`` (HF directories of the same
architecture) or, for the reference without a path, the actor's initial weights. ``ref.path`` may also
be an rlrun checkpoint directory (``ref.step`` picks ``step_N``, else the newest complete one): each
rank loads its own shard's model state, so the run must have the checkpoint's parallel layout.

The old-policy forward is skipped when the training forward can reuse its own log-probs
(``can_reuse_logprobs``); the loss then takes the detached training log-probs as the old ones.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlrun.algo import specs
from rlrun.megatron.weight_backup import WeightBackup

if TYPE_CHECKING:
    from rlrun.config.schema import AlgorithmConfig
    from rlrun.data.batch import MicroBatch
    from rlrun.megatron.model import MegatronModel


def can_reuse_logprobs(cfg: AlgorithmConfig, num_optimizer_steps: int = 1) -> bool:
    """Whether the old-policy log-probs equal the training forward's own (so the no-grad forward can
    be skipped). slime's ``can_reuse_log_probs_in_loss``, term by term:

    one optimizer step per rollout   the weights do not move between the micro-batches' forwards
    loss_type policy                 sft / custom losses may read ``old_logprobs``
    no KL reward penalty             it needs old log-probs before training, to build the advantages
    no use_rollout_logprobs          the old policy is the engine's then (no forward either way)
    no critic estimator (ppo)        values / GAE are computed before training
    no old actor                     the old policy is other weights than the training ones
    no OPD                           the teacher penalty needs old log-probs before training
    not the GSPO loss                (slime: its sequence ratio needs the full old sequence up front)
    no custom advantage              a user estimator may read ``old_logprobs``
    slime's "no mismatch metrics" and "no routing replay" have no counterpart: rlrun computes mismatch
    metrics inside the loss, from the same old log-probs either way; with routing replay the training
    forward replays the engine's routing (``rollout``: what the old forward would replay too) or routes
    at the old weights (``trainer``: what the old forward would record), so reuse stays exact.
    """
    return (
        num_optimizer_steps == 1
        and cfg.loss_type == "policy"
        and cfg.kl.reward_coef == 0
        and not cfg.use_rollout_logprobs
        and not specs.estimator(cfg).entry.needs_critic
        and specs.policy_loss(cfg).entry.reuses_logprobs
        and not cfg.keep_old_actor
        and not cfg.uses_teacher
        and cfg.custom_advantage is None
    )


class ModelRoles:
    """The role weights of one rank's model and the forward passes that fill micro-batch log-probs."""

    def __init__(
        self, cfg: AlgorithmConfig, model: MegatronModel, backup: WeightBackup | None, num_optimizer_steps: int = 1
    ) -> None:
        from rlrun.megatron.routing_replay import RoutingReplay

        self.cfg = cfg
        self.model = model
        self.backup = backup
        """None when no role other than the actor exists (nothing is ever swapped)."""
        self.reuse_logprobs = can_reuse_logprobs(cfg, num_optimizer_steps)
        self.ref_is_a_copy = _ref_is_a_copy(cfg, model)
        """Whether the reference is the ``ref`` backup, swapped in (else the adapters-off model, or none)."""
        self.routing: RoutingReplay | None = RoutingReplay.create(model, cfg.routing_replay)
        """MoE routing replay around the forwards (``algorithm.routing_replay``); None when off."""

    @classmethod
    def create(cls, cfg: AlgorithmConfig, model: MegatronModel, num_optimizer_steps: int = 1) -> ModelRoles:
        """Back up the actor and load every configured role; the model holds the actor on return.
        ``num_optimizer_steps``: the updates per rollout step (reuse of the training forward needs one)."""
        ref_is_a_copy = _ref_is_a_copy(cfg, model)
        if not (ref_is_a_copy or cfg.swaps_teacher or cfg.keep_old_actor):
            return cls(cfg, model, None, num_optimizer_steps)
        # With LoRA and no teacher every role shares the frozen base: back up the adapters alone.
        backup = WeightBackup(model.module, trainable_only=model.lora is not None and not cfg.swaps_teacher)
        backup.backup("actor")
        if ref_is_a_copy:
            _load_ref(backup, model, cfg.ref.path, cfg.ref.step)
        if cfg.swaps_teacher:
            _load_role(backup, model, "teacher", cfg.opd.teacher_path)
        if cfg.keep_old_actor:
            backup.copy("actor", "old_actor")
        backup.restore("actor")
        return cls(cfg, model, backup, num_optimizer_steps)

    @property
    def needs_old_forward(self) -> bool:
        return not self.cfg.use_rollout_logprobs and not self.reuse_logprobs

    def fill_logprobs(self, micro_batches: list[MicroBatch], temperature: float) -> None:
        """Set ``old_logprobs`` / ``ref_logprobs`` / ``teacher_logprobs`` of every micro-batch (what the
        config uses); the model holds the actor's weights again on return."""
        if self.needs_old_forward and not self.cfg.keep_old_actor:
            self._fill(micro_batches, "old_logprobs", temperature)  # the live weights: no swap
        lora = self.model.lora
        if self.cfg.uses_ref and lora is not None:
            with lora.disabled():  # the frozen base: the live weights without the adapters
                self._fill(micro_batches, "ref_logprobs", temperature)
        swaps = [
            (tag, field)
            for tag, field, on in (
                ("old_actor", "old_logprobs", self.needs_old_forward and self.cfg.keep_old_actor),
                ("ref", "ref_logprobs", self.ref_is_a_copy),
                ("teacher", "teacher_logprobs", self.cfg.swaps_teacher),  # else: the teacher engine's
            )
            if on
        ]
        if not swaps:
            return
        assert self.backup is not None, "ModelRoles.create backs up the actor whenever a role exists"
        self.backup.backup("actor")
        for tag, field in swaps:
            self.backup.restore(tag)
            with lora.disabled() if lora is not None and tag == "teacher" else contextlib.nullcontext():
                self._fill(micro_batches, field, temperature)
        self.backup.restore("actor")

    def training_forward(self, micro_batches: list[MicroBatch]) -> contextlib.AbstractContextManager:
        """Wrap the training step: it replays the routing the config asks for (nothing when off)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.training_forward(micro_batches)

    def on_weights_synced(self) -> None:
        """Call after the engine got the actor's weights (a step's sync, or the first sync after a checkpoint
        restore): the old actor is what the engine samples with until the next sync (``engine.sync_interval``)."""
        if self.backup is not None and self.cfg.keep_old_actor:
            self.backup.backup("old_actor")

    def after_train_step(self, step: int) -> None:
        """Refresh the role backups from the just-updated actor (call after the optimizer step)."""
        if self.backup is None:
            return
        interval = self.cfg.ref.update_interval
        if self.ref_is_a_copy and interval is not None and (step + 1) % interval == 0:
            self.backup.backup("ref")

    def _fill(self, micro_batches: list[MicroBatch], field: str, temperature: float) -> None:
        from rlrun.megatron import compute_logprobs

        routing = contextlib.nullcontext() if self.routing is None else self.routing.role_forward(field, micro_batches)
        with torch.no_grad(), routing:
            for mb in micro_batches:
                # The policy's own log-probs follow the sampling distribution (top-p mask replay); the
                # reference and the teacher are scored over the whole vocabulary. The loss reads them under
                # its mask only, so only those positions are scored (the others read 0).
                kept_ids = mb.kept_ids if field == "old_logprobs" else None
                logprobs = compute_logprobs(
                    self.model, mb.tokens, mb.position_ids, temperature, kept_ids, scored=mb.loss_mask
                )
                setattr(mb, field, logprobs.float().cpu())


def _ref_is_a_copy(cfg: AlgorithmConfig, model: MegatronModel) -> bool:
    """Whether the reference is a weight backup (full fine-tuning); with LoRA it is the adapters-off model."""
    return cfg.uses_ref and model.lora is None


def _load_role(backup: WeightBackup, model: MegatronModel, tag: str, hf_dir: str | None) -> None:
    """Back up ``hf_dir``'s weights (None: the live weights) as ``tag``; leaves them in the model."""
    if hf_dir is not None:
        from rlrun.megatron.hf_config import ModelArch
        from rlrun.megatron.hf_weights import HFCheckpoint
        from rlrun.megatron.model import load_hf_weights

        arch = ModelArch.from_hf_dir(hf_dir)
        if arch != model.arch:
            raise ValueError(
                f"algorithm {tag} weights ({hf_dir}) must have the actor's architecture because they "
                f"are loaded into the actor's model; got {arch} vs {model.arch}"
            )
        load_hf_weights(model.module, model.arch, HFCheckpoint(hf_dir), model.parallel)
    backup.backup(tag)


def _load_ref(backup: WeightBackup, model: MegatronModel, path: str | None, step: int | None) -> None:
    """Back up the reference weights as ``ref`` from an HF directory, an rlrun checkpoint or the live weights."""
    from rlrun.megatron.checkpoint import load_model_shard
    from rlrun.trainer.checkpoint import read_model_shard

    parallel = model.parallel
    # Rank 0 picks the checkpoint so every rank loads the same step even if the directory changes meanwhile;
    # its error is raised on every rank, so none waits in a collective for a rank that failed.
    choice: list[Path | ValueError | None] = [None]
    if parallel.is_rank0:
        try:
            choice = [_ref_checkpoint(path, step)]
        except ValueError as exc:
            choice = [exc]
    dist.broadcast_object_list(choice, src=0, group=parallel.cpu_group)
    if isinstance(choice[0], ValueError):
        raise choice[0]
    if choice[0] is None:
        _load_role(backup, model, "ref", path)
        return
    fix = "or point algorithm.ref.path at Hugging Face weights of that model"
    load_model_shard(model, read_model_shard(choice[0], parallel, fix))
    backup.backup("ref")
    if parallel.is_rank0:
        print(f"[rlrun] reference weights: {choice[0]}", flush=True)


def _ref_checkpoint(path: str | None, step: int | None) -> Path | None:
    """The complete checkpoint ``ref.path`` / ``ref.step`` name, or None when ``path`` is no rlrun
    checkpoint directory (an HF directory, or None)."""
    from rlrun.trainer.checkpoint import COMPLETE, complete_checkpoints

    if path is None:
        return None
    root = Path(path)
    is_step_dir = root.name.startswith("step_") and root.name[len("step_") :].isdigit()
    if not is_step_dir and not any(root.glob("step_*")):
        if step is not None:
            raise ValueError(
                f"algorithm.ref.step ({step}) must be unset when algorithm.ref.path ({path}) is not "
                f"an rlrun checkpoint directory because only checkpoints have steps; point ref.path "
                f"at a checkpoint.dir holding step_* directories, or unset ref.step"
            )
        return None
    if is_step_dir:
        if not (root / COMPLETE).is_file():
            raise ValueError(
                f"algorithm.ref.path ({path}) must be a complete checkpoint (with a {COMPLETE} "
                f"marker) because only complete checkpoints hold every rank's shard; pick one of "
                f"{[str(p) for _, p in complete_checkpoints(root.parent)] or 'none found'}"
            )
        if step is not None and int(root.name[len("step_") :]) != step:
            raise ValueError(
                f"algorithm.ref.step ({step}) must match the checkpoint algorithm.ref.path ({path}) "
                f"names because a step directory holds one step; unset ref.step, or point ref.path "
                f"at {root.parent}"
            )
        return root
    found = complete_checkpoints(root)
    for n, step_dir in reversed(found):
        if step is None or n == step:
            return step_dir
    raise ValueError(
        f"algorithm.ref.step ({step}) must name a complete checkpoint in algorithm.ref.path ({path}) "
        f"because only complete checkpoints hold every rank's shard; available complete steps: "
        f"{[n for n, _ in found] or 'none'}"
    )
