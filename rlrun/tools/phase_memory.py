"""Device memory of each phase of a step on one GPU, trainer and engine together (``rlrun doctor CONFIG``).

Every rank's engine shares its GPU with the trainer (docs/architecture.md; with ``placement.engine_ranks`` the
engines have GPUs of their own: :func:`_engine_ranks_phases`), so a step fits when each placement fits
(rlrun/trainer/offload.py; GiB per device, the trainer's terms from rlrun/tools/memory_estimate.py):

    rollout   engine awake  + trainer asleep (offload.train) or awake with its train-phase blocks cached
    logprobs  trainer: context + static + one micro-batch's no-grad forward (one layer's activations and the LM
              head over ``train.max_tokens_per_micro_batch`` tokens: the pass runs the train micro-batches one at
              a time, rlrun/trainer/roles.py ``_fill``)  + engine released (offload.rollout) or awake
    train     trainer: context + the trainer estimate (+ with offload.train and optimizer.cpu_offload the device
              Adam's fp32 temporary: Megatron's host-offload optimizer steps its device part with torch's foreach
              Adam, whose square root of the second moments lives in the trainer's region and so cannot reuse the
              activations' freed blocks of torch's default pool; every other Adam steps fused, in place,
              rlrun.megatron.train.fuse_adam)  + engine released or awake
    sync      the trainer as in train (its cached blocks stay until it sleeps) + one ``engine.bucket_bytes``
              bucket + the engine's weights (and its KV cache without offload.rollout)

The engine awake: its weights (the whole HF model in the model's dtype, split over ``engine.tp`` by a backend
that shards) and overhead, plus

* a batch-sized KV cache (the embedded engine): ``rows x round_up(prompt + max_new_tokens, 128)`` columns of
  ``layers x 2 x kv_heads x head_dim`` (MLA: the kv latent and the RoPE key), ``rows`` the samples of the
  prompts one engine gets in a round (``rollout.over_sampling_prompts`` or ``prompts_per_step`` over the
  ``world / engine.tp`` engines, times ``samples_per_prompt``), capped by ``max_running_requests`` and rounded
  to the decode batch's row bucket; plus the decode buffers (token ids, log-probs, mask; the top-p/top-k kept
  sets; the sampling noise) and the prefill's K/V of the prompts (kept for the call). The batch stays warm after
  the call until the engine is released; other warm shapes (eval, a short last round) may add up to
  ``decode_graphs.WARM_BYTES``, not counted.
* or a static pool (SGLang, ``BackendTraits.kv_pool_fraction_arg``): ``mem_fraction_static`` of the device for
  weights and KV cache together (unset: SGLang sizes it from the memory free when it starts; not counted).

The constants below (what the sleeping trainer keeps with and without ``offload.teardown_nccl``: CUDA context and NCCL
communicators, the awake trainer assumed to hold the latter besides its tensors; what a released engine keeps: its CUDA
context) are one GPU's offload run (BENCHMARKS.md, "Offload: trainer and engine taking turns on one GPU"). Not counted:
the allocators' fragmentation, and what the trainer estimate leaves out (its docstring). Not yet checked against a
colocated timeline: scripts/gpu/step_memory.sh records one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlrun.engine.registry import backend_traits
from rlrun.tools.memory_estimate import GIB, estimate, layer_elements_per_token, rank_params

if TYPE_CHECKING:
    from rlrun.config.schema import RunConfig
    from rlrun.megatron.hf_config import ModelArch

GB = 1e9
TRAINER_CONTEXT_GIB = 3.0 * GB / GIB
"""The awake trainer's CUDA context and NCCL communicators (= what it keeps asleep without NCCL teardown)."""
TRAINER_ASLEEP_GIB = {True: 1.4 * GB / GIB, False: TRAINER_CONTEXT_GIB}
"""What the sleeping trainer keeps, by ``offload.teardown_nccl`` (rlrun/config/schema.py, BENCHMARKS.md)."""
ENGINE_CONTEXT_GIB = 0.8 * GB / GIB
"""A released engine: its CUDA context and kernels (``memory/train/engine_gb`` of the offload run)."""
DECODE_BYTES_PER_COLUMN = 8 + 4 + 1
"""Per row and cache column: the sampled token (int64), its log-prob (fp32) and the attention mask (bool)."""
NOISE_BYTES_PER_COLUMN = 4
"""Per row and column of a sampling batch (not greedy, ``top_k != 1``): the tabulated sampling noise (fp32,
``DecodeBatch.noise``)."""


@dataclass(frozen=True)
class PhaseMemory:
    """One placement's device memory (GiB by part) and the fields that lower it."""

    phase: str
    parts: dict[str, float]
    fixes: list[str]

    @property
    def total_gib(self) -> float:
        return sum(self.parts.values())


def kv_bytes_per_token(arch: ModelArch, elem: int) -> int:
    """K and V of one token over every layer, as the embedded engine caches them."""
    if arch.mla is not None:
        return arch.num_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * elem
    return arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * elem


def engine_rows(cfg: RunConfig, world: int) -> tuple[int, int]:
    """(decode rows, distinct prompts) of one engine's generate call in a round (module docstring)."""
    from rlrun.engine.embedded.decode_batch import row_bucket

    rollout = cfg.rollout
    engines = max(world // cfg.engine.tp, 1)
    prompts = math.ceil((rollout.over_sampling_prompts or rollout.prompts_per_step) / engines)
    rows = prompts * rollout.samples_per_prompt
    cap = cfg.engine.server_args.get("max_running_requests")
    return row_bucket(rows if cap is None else min(rows, cap)), prompts


def engine_awake(
    cfg: RunConfig, arch: ModelArch, world: int, device_gib: float | None, prompt_tokens: int
) -> dict[str, float]:
    """GiB of the engine with its weights and KV cache (module docstring), by part; the weights come first."""
    from rlrun.engine.embedded.decode_run import LEN_ALIGN
    from rlrun.engine.sampling import KEPT_SET_WIDTH

    traits = backend_traits(cfg.engine.backend)
    elem = 2 if cfg.model.dtype == "bfloat16" else 4
    weights = rank_params(arch, 1, 1, 1) * elem / (cfg.engine.tp if traits.shards_over_tp else 1) / GIB
    parts = {"engine weights": weights, "engine context": ENGINE_CONTEXT_GIB}
    if traits.kv_pool_fraction_arg is not None:
        fraction = cfg.engine.server_args.get(traits.kv_pool_fraction_arg)
        if fraction is not None and device_gib is not None:
            parts[f"engine KV pool ({traits.kv_pool_fraction_arg} {fraction} less weights)"] = max(
                fraction * device_gib - weights, 0.0
            )
        return parts
    rows, prompts = engine_rows(cfg, world)
    columns = -(-(prompt_tokens + cfg.rollout.max_new_tokens) // LEN_ALIGN) * LEN_ALIGN
    filters = cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0
    per_column = DECODE_BYTES_PER_COLUMN + (NOISE_BYTES_PER_COLUMN if cfg.rollout.top_k != 1 else 0)
    per_column += 8 * min(KEPT_SET_WIDTH, arch.vocab_size) if filters else 0
    kv = kv_bytes_per_token(arch, elem)
    parts[f"engine KV cache ({rows} rows x {columns})"] = rows * columns * kv / GIB
    parts["engine decode buffers"] = rows * columns * per_column / GIB
    parts["engine prefill K/V"] = prompts * prompt_tokens * kv / GIB
    return parts


def phase_memory(
    cfg: RunConfig, arch: ModelArch, dp: int, world: int, device_gib: float | None, prompt_tokens: int
) -> list[PhaseMemory]:
    """Each placement's GiB on one device for ``cfg`` (module docstring): ``dp`` data-parallel ranks, ``world``
    ranks, ``device_gib`` of device memory (None: unknown, a fraction-sized engine pool is then not counted),
    ``prompt_tokens`` the longest prompt."""
    off, train = cfg.offload, cfg.train
    e = estimate(cfg, arch, dp)
    static = e.weights_gib + e.grads_gib + e.optimizer_gib
    elem = 2 if cfg.model.dtype == "bfloat16" else 4
    shard = dp if cfg.optimizer.use_distributed_optimizer else 1
    offloaded = cfg.optimizer.offload_fraction if cfg.optimizer.cpu_offload else 0.0
    params = rank_params(arch, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)
    trainer = {
        "trainer context": TRAINER_CONTEXT_GIB,
        "trainer static": static,
        "trainer activations": e.activations_gib,
        "trainer LM head": e.lm_head_gib,
    }
    if off.train and cfg.optimizer.cpu_offload:  # foreach Adam on the device part: sqrt of the second moments
        trainer["trainer optimizer-step temporary"] = params * 4 * (1 - offloaded) / shard / GIB
    tokens = train.max_tokens_per_micro_batch / cfg.parallel.cp
    logprobs = {
        "trainer context": TRAINER_CONTEXT_GIB,
        "trainer static": static,
        "trainer forward": tokens * layer_elements_per_token(arch, cfg.parallel.tp, "none") * elem / GIB,
        "trainer LM head": e.lm_head_gib,
    }
    awake = engine_awake(cfg, arch, world, device_gib, prompt_tokens)
    released = {"engine context": ENGINE_CONTEXT_GIB} if off.rollout else awake
    sleeping = {"trainer asleep": TRAINER_ASLEEP_GIB[off.teardown_nccl]} if off.train else trainer
    weights_only = {k: awake[k] for k in ("engine weights", "engine context")}
    synced = weights_only if off.rollout else awake

    engine_ranks = cfg.placement.engine_ranks > 0
    trainer_fixes = [
        f
        for f, applied in (
            ("set train.recompute: full", train.recompute == "full"),
            ("set model.lm_head: chunked", cfg.model.lm_head == "chunked"),
            ("set optimizer.use_distributed_optimizer + optimizer.cpu_offload", cfg.optimizer.cpu_offload),
            # with engine ranks no engine sits beside the trainer (and offload is refused)
            ("set offload.rollout: true (the engine releases its memory)", off.rollout or engine_ranks),
        )
        if not applied
    ] + ["lower train.max_tokens_per_micro_batch"]
    fraction_arg = backend_traits(cfg.engine.backend).kv_pool_fraction_arg
    if fraction_arg is not None:
        rollout_fixes = [f"lower engine.server_args.{fraction_arg}"]
    else:
        rollout_fixes = [
            "cap engine.server_args.max_running_requests",
            "lower rollout.prompts_per_step x rollout.samples_per_prompt or rollout.max_new_tokens",
        ]
    if engine_ranks:
        return _engine_ranks_phases(cfg, trainer, logprobs, awake, trainer_fixes, rollout_fixes)
    if not off.train:
        rollout_fixes.append("set offload.train: true (the trainer sleeps)")
    return [
        PhaseMemory("rollout", {**awake, **sleeping}, rollout_fixes),
        PhaseMemory("logprobs", {**logprobs, **released}, trainer_fixes),
        PhaseMemory("train", {**trainer, **released}, trainer_fixes),
        PhaseMemory(
            "sync",
            {**trainer, "sync bucket": cfg.engine.bucket_bytes / GIB, **synced},
            ["lower engine.bucket_bytes"] + trainer_fixes,
        ),
    ]


def _engine_ranks_phases(
    cfg: RunConfig,
    trainer: dict[str, float],
    logprobs: dict[str, float],
    awake: dict[str, float],
    trainer_fixes: list[str],
    rollout_fixes: list[str],
) -> list[PhaseMemory]:
    """``placement.engine_ranks``: the engines on GPUs of their own. A training rank's GPU holds the trainer alone (rank
    0 also the bucket it broadcasts); an engine rank's holds its engine awake, its own process (CUDA, the broadcast's
    communicator) and the bucket it receives with each tensor's aligned copy handed to the worker (two buckets)."""
    bucket = cfg.engine.bucket_bytes / GIB
    engine_rank = {**awake, "rank process (CUDA, NCCL)": TRAINER_CONTEXT_GIB, "sync buckets received": 2 * bucket}
    return [
        PhaseMemory("rollout (engine rank)", engine_rank, rollout_fixes + ["lower engine.bucket_bytes"]),
        PhaseMemory("logprobs", logprobs, trainer_fixes),
        PhaseMemory("train", trainer, trainer_fixes),
        PhaseMemory("sync", {**trainer, "sync bucket": bucket}, ["lower engine.bucket_bytes"] + trainer_fixes),
    ]
