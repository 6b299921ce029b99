"""MoE routing replay (``algorithm.routing_replay``): the trainer's forwards route tokens to given experts.

Why: an MoE trainer and its engine route some tokens differently (different kernels and precision flip
near-tied router scores), so the trainer's log-probs are of other experts than the sampled tokens'.

* ``trainer`` (R2): the old-policy forward routes on its own and records the choices; the training
  forward replays them, so the policy ratio compares the same experts before and after the update.
* ``rollout`` (R3, arXiv 2510.11370): every forward of the step (old, reference, teacher, training)
  replays the engine's choices (``MicroBatch.routed_experts``, recorded by the engine).

Mechanism: Megatron's ``RouterReplay`` (what ``moe_enable_routing_replay`` gives each ``TopKRouter``;
attached here to this model's routers, so the config stays as built). Its ``REPLAY_FORWARD`` action
makes the router take the target ids and gather their scores; ``RECORD`` keeps the ids it chose. A
forward pre-hook on the GPTModel loads the next micro-batch's targets before each forward, because
both the schedule (1F1B included: every stage forwards the micro-batches in order) and the role
forwards run the micro-batches in list order. No activation recomputation is configured, so the
backward never re-runs a router (``REPLAY_BACKWARD`` is not needed).

Token layout the router sees (``TopKRouter.routing``: ``logits.view(-1, experts)``): the decoder input
flattened sequence-major, i.e. ``[S, B]`` for plain rows and the rows' concatenation for packed ones
(thd ``[T, 1]``); every rank of a pipeline stage sees all of its micro-batch's tokens, because MoE models
run at TP 1 (``rlrun.megatron.moe.moe_config_kwargs``: no sequence parallelism to split them) and expert
parallelism dispatches tokens only after routing. Layers: each pipeline stage's routers take their own
MoE layers' slice of the engine's ``[.., moe_layers, topk]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from rlrun.algo.specs import RoutingReplayMode as Mode

if TYPE_CHECKING:
    from rlrun.data.batch import MicroBatch
    from rlrun.megatron.model import MegatronModel


class RoutingReplay:
    """Replay (and, for ``trainer``, recording) of one rank's MoE routing around the step's forwards."""

    def __init__(self, model: MegatronModel, mode: Mode) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self._actions = RouterReplayAction
        self.model = model
        self.mode = mode
        layers = [
            layer for layer in model.module.decoder.layers if isinstance(getattr(layer.mlp, "router", None), TopKRouter)
        ]
        moe_flags = model.arch.moe.moe_layers
        self.moe_layers = [sum(moe_flags[: layer.layer_number - 1]) for layer in layers]
        """This stage's routers as indices into an engine layer axis of MoE layers only (embedded engine)."""
        self.model_layers = [layer.layer_number - 1 for layer in layers]
        """The same as indices into an axis of every decoder layer (SGLang returns one row per layer)."""
        for layer in layers:
            if layer.mlp.router.router_replay is None:
                layer.mlp.router.router_replay = RouterReplay()
        self.replays = [layer.mlp.router.router_replay for layer in layers]
        self._targets: list[list[torch.Tensor]] = []
        self._recorded: list[list[torch.Tensor]] = []
        self._recording = False
        model.module.register_forward_pre_hook(self._before_forward)
        model.module.register_forward_hook(self._after_forward)

    @classmethod
    def create(cls, model: MegatronModel, mode: Mode) -> RoutingReplay | None:
        if mode == "none":
            return None
        if model.arch.moe is None:
            raise ValueError(
                f"algorithm.routing_replay ({mode!r}) must be 'none' for a dense model because only "
                f"MoE routers have routing to replay; set algorithm.routing_replay: none"
            )
        return cls(model, mode)

    # ---- what the step calls ----------------------------------------------------------------------

    @contextlib.contextmanager
    def role_forward(self, field: str, micro_batches: Sequence[MicroBatch]) -> Iterator[None]:
        """Around one role's no-grad forward over ``micro_batches`` (``field``: the log-probs it fills):
        ``rollout`` replays the engine's routing; ``trainer`` records the old policy's own."""
        if self.mode == "rollout":
            with self._replaying([self.engine_targets(mb) for mb in micro_batches]):
                yield
        elif field == "old_logprobs":
            with self._record():
                yield
        else:
            yield

    @contextlib.contextmanager
    def training_forward(self, micro_batches: Sequence[MicroBatch]) -> Iterator[None]:
        """Around the training step: replay the engine's routing (``rollout``) or the old forward's
        (``trainer``; nothing recorded means the old forward was skipped because the training forward
        runs at the old weights, so its own routing already is the old one)."""
        if self.mode == "rollout":
            targets = [self.engine_targets(mb) for mb in micro_batches]
        else:
            targets, self._recorded = self._recorded, []
            if not targets:
                yield
                return
        if len(targets) != len(micro_batches):
            raise RuntimeError(
                f"routing replay holds {len(targets)} recorded micro-batches for "
                f"{len(micro_batches)} to train on; the old forward must cover the same ones"
            )
        with self._replaying(targets):
            yield

    def engine_targets(self, mb: MicroBatch) -> list[torch.Tensor]:
        """Per router of this stage, ``[tokens, topk]`` int64 ids from ``mb.routed_experts`` in the token
        order this rank's router sees (module docstring)."""
        from rlrun.megatron.attention import packed_seq_params

        if mb.routed_experts is None:
            raise ValueError(
                "algorithm.routing_replay ('rollout') needs the engine's routed experts in every "
                "micro-batch because they are replayed; use the embedded engine or SGLang with "
                "enable_return_routed_experts, and no multi-turn generate_fn"
            )
        experts = mb.routed_experts
        if packed_seq_params(mb.position_ids, torch.device("cpu")) is None:
            experts = experts.transpose(0, 1)  # sbhd: the router sees [S, B]
        flat = experts.reshape(-1, *experts.shape[2:])
        moe_flags = self.model.arch.moe.moe_layers
        if flat.shape[1] == sum(moe_flags):
            index = self.moe_layers
        elif flat.shape[1] == len(moe_flags):
            index = self.model_layers
        else:
            raise ValueError(
                f"routed experts have {flat.shape[1]} layers but the model has {len(moe_flags)} "
                f"decoder layers, {sum(moe_flags)} of them MoE; the engine must serve model.path"
            )
        device = self.model.parallel.device
        return [flat[:, layer].to(device=device, dtype=torch.long) for layer in index]

    # ---- the hooks ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _replaying(self, targets: list[list[torch.Tensor]]) -> Iterator[None]:
        self._targets = list(targets)
        self._set_action(self._actions.REPLAY_FORWARD)
        try:
            yield
        finally:
            self._targets = []
            self._set_action(None)

    @contextlib.contextmanager
    def _record(self) -> Iterator[None]:
        self._recorded, self._recording = [], True
        self._set_action(self._actions.RECORD)
        try:
            yield
        finally:
            self._recording = False
            self._set_action(None)

    def _set_action(self, action) -> None:
        for replay in self.replays:
            replay.clear_indices()
            if action is None:
                replay.clear_router_replay_action()
            else:
                replay.set_router_replay_action(action)

    def _before_forward(self, _module, _args) -> None:
        if not self._targets:
            return
        for replay, target in zip(self.replays, self._targets.pop(0), strict=False):
            replay.clear_indices()
            replay.set_target_indices(target)

    def _after_forward(self, _module, _args, _output) -> None:
        if self._recording:
            self._recorded.append([replay.get_recorded_indices().detach().clone() for replay in self.replays])
