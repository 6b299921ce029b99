"""Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, GLM-4.5 MoE): their architecture, options and HF weight names.

An MoE decoder layer replaces the dense SwiGLU MLP with a router (``gate``: ``[num_experts, hidden]``)
that sends each token to its ``topk`` best experts (each a SwiGLU MLP of ``moe_ffn_hidden_size``) and
sums their outputs weighted by the routing probabilities. Qwen2-MoE adds a shared expert that every
token passes through, scaled by ``sigmoid(shared_expert_gate(x))``.

Routing, HF vs Megatron (both score with a softmax over the router logits):

* ``norm_topk_prob=False`` (Qwen2-MoE, Qwen3-MoE by default): softmax over all experts, then top-k, the
  k probabilities used as they are: Megatron's ``moe_router_pre_softmax=True``;
* ``norm_topk_prob=True``: the top-k probabilities renormalised to sum to 1, which equals a softmax over
  the top-k logits: Megatron's default (``moe_router_pre_softmax=False``).

GLM-4.5 MoE (``glm4_moe``) and DeepSeek-V3 (``deepseek_v3``, whose router transformers implements identically)
score with a sigmoid instead: experts are picked by ``sigmoid(logit) + b`` with
the checkpoint's score-correction bias ``b`` (``mlp.gate.e_score_correction_bias``), weighted by their
``sigmoid(logit)`` renormalised over the top k, times ``routed_scaling_factor``: Megatron's
``moe_router_score_function="sigmoid"`` with ``moe_router_enable_expert_bias`` (the bias is Megatron's
``router.expert_bias`` buffer) and ``moe_router_topk_scaling_factor``. Megatron renormalises sigmoid scores
whenever ``topk > 1``, so ``norm_topk_prob: false`` is refused. ``b`` stays the checkpoint's
(``moe_router_bias_update_rate=0``): the engine routes with the same bias, and Megatron's aux-loss-free
balancing would move the trainer's routing away from it. Group-limited routing (``n_group > 1``) picks
groups by the sum of their top ``topk // topk_group`` scores in Megatron and their top 2 in transformers,
so it is accepted only where the two agree. The first ``first_k_dense_replace`` layers are dense, and
``n_shared_experts * moe_intermediate_size`` wide ungated shared experts (``mlp.shared_experts``) see
every token. Its multi-token-prediction layers (``num_nextn_predict_layers``) are not used by transformers'
model, nor loaded here.

Megatron names (local spec, ``SequentialMLP`` experts) and their HF sources, layer ``i``:

==================================================  ===============================================
decoder.layers.i.mlp.router.weight                  model.layers.i.mlp.gate.weight
decoder.layers.i.mlp.experts.local_experts.j.       model.layers.i.mlp.experts.e.{gate,up}_proj
linear_fc1.weight                                   (``[gate; up]``; ``e = ep_rank * local + j``)
decoder.layers.i.mlp.experts.local_experts.j.       model.layers.i.mlp.experts.e.down_proj
linear_fc2.weight
decoder.layers.i.mlp.shared_experts.linear_fc1      model.layers.i.mlp.shared_expert.{gate,up}_proj
decoder.layers.i.mlp.shared_experts.linear_fc2      model.layers.i.mlp.shared_expert.down_proj
decoder.layers.i.mlp.shared_experts.gate_weight     model.layers.i.mlp.shared_expert_gate.weight
decoder.layers.i.mlp.router.expert_bias (buffer)    model.layers.i.mlp.gate.e_score_correction_bias
==================================================  ===============================================

(GLM-4.5's shared experts are ``mlp.shared_experts.*``, plural, without a gate.)

Expert parallelism: the ``num_experts`` experts are split into ``ep`` equal consecutive blocks, EP rank
``r`` holding experts ``[r * E/ep, (r + 1) * E/ep)`` as ``local_experts.0 ...``. Each expert's weights
are further split over the ``etp`` expert-tensor-parallel ranks like a dense MLP (Megatron marks them
``tensor_model_parallel`` with the same partition attributes, see ``tp_layout``).

The per-expert names are the layout of real Qwen3-MoE checkpoints and of what transformers 5
``save_pretrained`` writes (it unfuses its in-memory ``experts.gate_up_proj [E, 2I, H]`` on save);
``HFCheckpoint`` readers see only those names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlrun.config.schema import Dispatcher, LoadBalancing

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3")


@dataclass(frozen=True)
class MoEArch:
    """The MoE part of an HF ``config.json``."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    """Each routed expert's intermediate size (``moe_intermediate_size``)."""
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    """Per layer, whether it is an MoE layer (``decoder_sparse_step`` and ``mlp_only_layers``)."""
    router_aux_loss_coef: float
    shared_expert_ffn_hidden_size: int = 0
    """Qwen2-MoE's ``shared_expert_intermediate_size``; 0: no shared expert."""
    shared_expert_gate: bool = True
    """Qwen2-MoE scales its shared expert by ``sigmoid(shared_expert_gate(x))``; GLM-4.5's has no gate."""
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    expert_bias: bool = False
    """A score-correction bias added to the scores for choosing experts only (GLM-4.5)."""
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float | None = None
    """``routed_scaling_factor``: multiplies the routed experts' weights."""

    @property
    def shared_expert_prefix(self) -> str:
        return "shared_expert" if self.shared_expert_gate else "shared_experts"

    @classmethod
    def from_dict(cls, cfg: dict, path: Path, num_layers: int) -> MoEArch:
        if cfg.get("model_type") in ("glm4_moe", "deepseek_v3"):  # the same router and layout
            return cls._glm4_moe(cfg, path, num_layers)
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        topk = cfg["num_experts_per_tok"]
        if not num_experts or not 1 <= topk <= num_experts:
            raise ValueError(
                f"{path}: num_experts_per_tok ({topk}) must be between 1 and num_experts "
                f"({num_experts}) because each token picks that many distinct experts; "
                f"this config.json does not describe a routed MoE model"
            )
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        return cls(
            num_experts=num_experts,
            topk=topk,
            ffn_hidden_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=moe_layers,
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
            shared_expert_ffn_hidden_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )

    @classmethod
    def _glm4_moe(cls, cfg: dict, path: Path, num_layers: int) -> MoEArch:
        """GLM-4.5 MoE and DeepSeek-V3: sigmoid routing with a correction bias, dense first layers, ungated shared
        experts (transformers' two routers are the same code)."""
        num_experts, topk = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        num_groups, group_topk = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
        if topk > 1 and not cfg.get("norm_topk_prob", True):
            raise ValueError(
                f"{path}: norm_topk_prob (False) must be true because Megatron's sigmoid router always "
                f"renormalises the top-{topk} scores; use a model with norm_topk_prob: true"
            )
        if num_groups > 1 and topk // group_topk != 2:
            raise ValueError(
                f"{path}: num_experts_per_tok // topk_group ({topk} // {group_topk}) must be 2 because Megatron "
                f"ranks expert groups by their top {topk // group_topk} scores and transformers by their top 2; "
                f"use a model with n_group: 1 or such a ratio"
            )
        first_dense = cfg.get("first_k_dense_replace") or 0
        return cls(
            num_experts=num_experts,
            topk=topk,
            ffn_hidden_size=cfg["moe_intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(i >= first_dense for i in range(num_layers)),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)),
            shared_expert_ffn_hidden_size=int(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"],
            shared_expert_gate=False,
            score_function="sigmoid",
            expert_bias=True,
            num_groups=num_groups if num_groups > 1 else None,
            group_topk=group_topk if num_groups > 1 else None,
            scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        )


@dataclass(frozen=True)
class MoEOptions:
    """How the trainer routes and balances (Megatron's ``moe_*`` options): ``schema.MoEConfig``'s fields,
    ``MoEOptions(**cfg.model.moe.model_dump())``.

    ``aux_loss_coeff=None`` takes the checkpoint's ``router_aux_loss_coef``. ``token_dispatcher="auto"`` is
    ``alltoall`` on CUDA and ``allgather`` on CPU: Megatron 0.16's all-to-all dispatcher creates a
    ``torch.cuda.Stream`` for its device-to-host copies in its constructor, which fails without CUDA,
    while the all-gather dispatcher is plain collectives (gloo runs it).
    """

    load_balancing: LoadBalancing = "aux_loss"
    aux_loss_coeff: float | None = None
    z_loss_coeff: float | None = None
    token_dispatcher: Dispatcher = "auto"

    def resolved_dispatcher(self) -> str:
        """The Megatron ``moe_token_dispatcher_type`` on this machine."""
        import torch

        if self.token_dispatcher == "auto":
            return "alltoall" if torch.cuda.is_available() else "allgather"
        if self.token_dispatcher == "alltoall" and not torch.cuda.is_available():
            raise ValueError(
                "model.moe.token_dispatcher ('alltoall') must run on CUDA because Megatron's all-to-all "
                "dispatcher creates CUDA streams; set model.moe.token_dispatcher to 'allgather' or 'auto'"
            )
        return self.token_dispatcher


def moe_config_kwargs(moe: MoEArch, options: MoEOptions, tp: int, ep: int, etp: int) -> dict:
    """The ``TransformerConfig`` arguments of the MoE layers."""
    if tp > 1:
        raise ValueError(
            f"parallel.tp ({tp}) must be 1 for MoE models because Megatron's MoE layer refuses to "
            f"train with TP > 1 without sequence parallelism, which the local (non-TE) layer spec's "
            f"torch norms do not support; split the experts with parallel.ep / parallel.etp instead"
        )
    if moe.num_experts % ep != 0:
        raise ValueError(
            f"parallel.ep ({ep}) must divide config.json num_experts ({moe.num_experts}) because "
            f"every expert-parallel rank holds the same number of experts; set parallel.ep to a divisor"
        )
    balancing = options.load_balancing
    coeff = moe.router_aux_loss_coef if options.aux_loss_coeff is None else options.aux_loss_coeff
    return dict(
        num_moe_experts=moe.num_experts,
        moe_layer_freq=[int(sparse) for sparse in moe.moe_layers],
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_pre_softmax=not moe.norm_topk_prob and moe.score_function == "softmax",
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=0.0,  # the checkpoint's correction bias, as the engine routes (see above)
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=0.0 if balancing == "none" else coeff,
        moe_z_loss_coeff=options.z_loss_coeff,
        moe_token_dispatcher_type=options.resolved_dispatcher(),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert_ffn_hidden_size > 0 and moe.shared_expert_gate,
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def moe_mlp_mappings(
    moe: MoEArch, mc: str, hf: str, ep_rank: int, ep_size: int
) -> list[tuple[str, tuple[str, ...], str]]:
    """``(megatron_name, hf_names, kind)`` of one MoE layer's MLP on EP rank ``ep_rank``: router, this
    rank's experts, shared expert. ``mc`` / ``hf`` are the layer prefixes (``decoder.layers.0.``)."""
    local = moe.num_experts // ep_size
    rows = [(f"{mc}mlp.router.weight", (f"{hf}mlp.gate.weight",), "copy")]
    if moe.expert_bias:
        rows.append((f"{mc}mlp.router.expert_bias", (f"{hf}mlp.gate.e_score_correction_bias",), "copy"))
    for j in range(local):
        expert = f"{hf}mlp.experts.{ep_rank * local + j}."
        mc_expert = f"{mc}mlp.experts.local_experts.{j}."
        rows.append(
            (f"{mc_expert}linear_fc1.weight", (f"{expert}gate_proj.weight", f"{expert}up_proj.weight"), "concat")
        )
        rows.append((f"{mc_expert}linear_fc2.weight", (f"{expert}down_proj.weight",), "copy"))
    if moe.shared_expert_ffn_hidden_size:
        shared = f"{hf}mlp.{moe.shared_expert_prefix}."
        rows.append(
            (
                f"{mc}mlp.shared_experts.linear_fc1.weight",
                (f"{shared}gate_proj.weight", f"{shared}up_proj.weight"),
                "concat",
            )
        )
        rows.append((f"{mc}mlp.shared_experts.linear_fc2.weight", (f"{shared}down_proj.weight",), "copy"))
        if moe.shared_expert_gate:
            rows.append((f"{mc}mlp.shared_experts.gate_weight", (f"{hf}mlp.shared_expert_gate.weight",), "copy"))
    return rows


def patch_router_without_te() -> None:
    """Let Megatron's router run without TransformerEngine; idempotent.

    megatron-core 0.16.1 ``moe_utils.RouterGatingLinearFunction`` tests ``te_general_gemm is not None``
    but defines that name only when TE imports, so without TE the router raises ``NameError``; ``None``
    selects its own ``torch.mm`` path, which is what it means to do.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def aux_loss_metrics(moe: MoEArch, num_micro_batches: int) -> dict[str, float]:
    """This train step's router losses from Megatron's tracker, then reset it; a collective (every rank).

    Megatron's routers record each load-balancing / z-loss (before its coefficient) per layer, summed over
    the step's micro-batches (training forwards only). Returned as ``moe_<name>`` (``moe_load_balancing_loss``,
    ``moe_z_loss``, ...): the mean over MoE layers and micro-batches, averaged over data-parallel ranks
    (Megatron's ``reduce_aux_losses_tracker_across_ranks``; PP stages' layers are summed in first).
    """
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    names = sorted(tracker)
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    per = sum(moe.moe_layers) * num_micro_batches
    metrics = {f"moe_{name}": float(tracker[name]["values"].sum()) / per for name in names}
    moe_utils.clear_aux_losses_tracker()
    return metrics


def reduce_expert_grads_over_expert_dp(gpt, ep: int, etp: int, tp: int) -> None:
    """Mark every routed expert's weight for the expert data-parallel gradient reduction where megatron-core
    0.16.1 does not: at ``ep == 1`` with ``etp != tp``.

    A parameter's ``allreduce`` attribute picks its gradient's DDP buffer, reduction group and optimizer:
    True, the dense ones (the data-parallel group, the model-parallel group's grad norm); False, the expert
    ones (expert data-parallel, expert TP x EP x PP). Megatron's linear layers set it False only where
    ``expert_model_parallel_size > 1``. At EP=1 with expert-TP=2 (TP=1) the data-parallel group holds the
    two expert-TP ranks, whose shards are different slices of each expert: left dense, DDP would sum the two
    slices into one gradient for both, and the grad norm would count each rank's slice as the whole expert.
    Megatron-LM's later rule is ``is_expert and (EP > 1 or ETP != TP)``; this applies it before the
    DDP wrap (tests/integration/test_moe_expert_tp.py)."""
    if ep > 1 or etp == tp:
        return
    for name, param in gpt.named_parameters():
        if is_expert_param(name):
            param.allreduce = False


def is_expert_param(megatron_name: str) -> bool:
    """Whether a parameter is one EP rank's routed expert (sharded over EP and ETP, not TP)."""
    return ".mlp.experts.local_experts." in megatron_name
