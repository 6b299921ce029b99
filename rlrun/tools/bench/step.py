"""``rlrun bench step``: seconds per GRPO step through the real loop, split by phase, on one device or
``ranks`` of them (DP=ranks, the same work per rank: weak scaling).

Each run is ``rlrun train`` under torchrun (one rank per device, trainer and engine colocated, offload on) on a
random-init model of a published shape, so the figures are the loop's own: ``time/<phase>_s`` and
``memory/*`` from ``metrics.jsonl`` (rlrun/trainer/loop.py), not a re-timing. The inputs are built once per
work directory and shared by every backend and by the TRL comparison (benchmarks/trl_grpo.py):

* the model: ``rlrun.tools.bench.shapes.write_random_model`` plus a WordLevel tokenizer over the whole
  vocabulary (token ``i`` is the word ``w<i>``; 0 is ``<pad>``, 1 is ``<eos>``, as the model's config says),
  so any sampled id decodes and a prompt of ``k`` words is exactly ``k`` tokens without a chat template;
* ``prompts.jsonl``: ``prompts`` rows of ``prompt_len`` random words (every step draws all of them).

Responses are forced to ``new_tokens`` tokens by ``rollout.ignore_eos``; the engine contract carries it
to both backends (embedded: no stop ids; sglang: ``ignore_eos``).
The reward (``even_token_reward``) has spread within a group so GRPO's advantages are not all zero.

Variants (:class:`Variant`, ``--offload``, ``--teardown-nccl``, ``--release-cache``, ``--optimizer-copy``,
``--packed-attention`` and ``--lora-rank``) change how rlrun runs the same work: offload off keeps trainer and
engine resident (what TRL does), with a smaller SGLang memory fraction so both fit; ``--lora-rank`` trains LoRA
adapters on the frozen base. Every step also carries the offloader's ``offload/*`` figures (trainer sleep/wake
seconds and GB and their parts, NCCL teardown/rebuild, the engine's release/resume seconds), so a slow ``offload``
phase says where its seconds went. ``--profile-step K`` records step K with the torch profiler and puts the train
phase's top ops into the JSON (rlrun/tools/bench/trace_ops.py); that step is left out of the medians.

Per step: the phases' seconds, output tokens (prompts x samples x new_tokens when the length held),
output tokens/s over the whole step and over the rollout, and memory (device-wide GB at each phase
mark, the trainer's peak allocation). Medians leave out the first ``warmup_steps`` (engine start-up
effects, CUDA graph capture, allocator growth, and the first sleep after Adam's moments exist: see
``WARMUP_STEPS``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

import yaml

from rlrun.config.schema import LMHead, OptimizerCopy, PackedAttention, RecomputeMode, ReleaseCache
from rlrun.engine.registry import backend_traits
from rlrun.observability.step_times import STEP_SECONDS, STEP_TOTALS, WALL_STEP_SECONDS
from rlrun.tools.bench.engines import BENCH_SERVER_ARGS, SGLANG_SERVER_ARGS
from rlrun.tools.bench.logged import run_logged
from rlrun.tools.bench.shapes import get_shape
from rlrun.tools.bench.trace_ops import PhaseProfile, phase_profile

TORCHRUN_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "OMP_NUM_THREADS": "4",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}
"""Defaults for the training processes; the caller's environment overrides them. NVLink multicast off
(the device notes say why), a few OpenMP threads per rank."""
WARMUP_STEPS = 2
"""Steps left out of the medians, for rlrun and TRL alike (benchmarks/trl_grpo.py imports it). Step 0
starts engines, captures graphs and creates Adam's moments; step 1 holds the first trainer sleep with
those moments, whose pinned host backup is allocated once (torch_memory_saver keeps it), so that
step's offload takes several times a steady step's, and with one warm-up step a 3-step median would average a
one-time cost into the steady state."""
RESIDENT_SGLANG_MEM_FRACTION = 0.15
"""SGLang's ``mem_fraction_static`` with offload off: weights + KV cache for 128 x 640 tokens (9.4 GB of
KV at Qwen3-0.6B/1.7B's 28 layers of 8 KV heads) fit beside a resident 1.7B trainer's peak (BENCHMARKS.md, "Step
against peers");
the offload runs keep SGLANG_SERVER_ARGS' 0.3, since the engine has the device to itself while it generates."""
ATTENTION_SUFFIX: dict[str, str] = {
    "auto": "",
    "per_sample": "_persample",
    "efficient_varlen": "_effvarlen",
    "chunked_varlen": "_chunked",
    "flash_varlen": "_varlen",
    "cudnn_per_sample": "_cudnn",
}
"""A variant's label suffix for each ``model.packed_attention`` (``auto``, the default, adds none)."""
HEAD_SUFFIX: dict[str, str] = {"chunked": "", "chunked_kept": "_headkept", "logits": "_headlogits"}
"""A variant's label suffix for each ``model.lm_head`` (``chunked``, the default, adds none)."""
PROFILED_PHASE = "train"
INPUTS = "inputs"
"""The folder of ``--work`` that holds the model and prompts every run shares."""


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What one ``bench step`` run does; the TRL script takes the same numbers (benchmarks/trl_grpo.py)."""

    shape: str = "qwen3-0.6b"
    backend: str = "embedded"
    prompts: int = 16
    samples: int = 8
    prompt_len: int = 128
    new_tokens: int = 512
    steps: int = 5
    micro_batch_samples: int = 32
    """Samples per training micro-batch (the token budget is this many full samples)."""
    lr: float = 1e-6
    seed: int = 0
    updates_per_rollout: int = 1
    """``train.updates_per_rollout``: optimizer steps each rollout is split into (PPO-style; above 1 the old-policy
    log-probs get their own forward pass before the first update)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """How rlrun runs the step (the work itself is :class:`StepSettings`', shared with TRL)."""

    offload: bool = True
    """Trainer and engine take turns on the device (``offload.train`` / ``offload.rollout``); off: both
    stay resident, as TRL's trainer and generation do."""
    teardown_nccl: bool = True
    """``offload.teardown_nccl``: destroy and rebuild Megatron's NCCL communicators at every sleep/wake
    (only with offload)."""
    packed_attention: PackedAttention = "auto"
    """``model.packed_attention``: ``auto`` (the config's default: one varlen attention call per layer on
    CUDA in bf16, else one SDPA call per sample) or either of them by name."""
    recompute: RecomputeMode = "none"
    """``train.recompute``: activation recompute of the trainer's layers (rlrun/megatron/recompute.py)."""
    optimizer_offload: bool = False
    """``optimizer.cpu_offload`` (with the distributed optimizer): Adam's state in host memory; CUDA only."""

    lora_rank: int | None = None
    """``model.lora`` with this rank (alpha = 2 x rank, every projection; rlrun/megatron/lora.py): the base
    frozen, only the adapters hold gradients and Adam state, merged weights synced. None: full fine-tuning."""
    optimizer_copy: OptimizerCopy = "overlapped"
    """``offload.optimizer_copy``: the optimizer's state copied back behind the forward pass, or with the weights
    by torch_memory_saver (only with offload)."""
    release_cache: ReleaseCache = "when_needed"
    """``offload.release_cache``: whether the sleeping trainer keeps its cached activation blocks when the engine
    fits beside them (only with offload)."""
    lm_head: LMHead = "chunked"
    """``model.lm_head``: the LM head by token chunks, projected again in the backward (the default) or kept
    (``chunked_kept``), or Megatron's output layer (``logits``)."""
    engine_ranks: int = 0
    """``placement.engine_ranks``: torchrun ranks beside the training ones that only generate (docs/async.md,
    "Disaggregated placement"; needs offload off). 0: every rank trains beside its own engine."""
    max_staleness: int = 0
    """``rollout.max_staleness``: rollouts generated up to this many steps ahead of training (docs/async.md)."""

    def label(self, base: str) -> str:
        """The run's name and folder: ``base`` (the backend) plus what differs from the default variant."""
        return (
            base
            + ("" if self.offload else "_resident")
            + ("" if self.teardown_nccl else "_keepnccl")
            + ("" if self.release_cache == "when_needed" else "_releasecache")
            + ("" if self.optimizer_copy == "overlapped" else "_copywithweights")
            + ATTENTION_SUFFIX[self.packed_attention]
            + HEAD_SUFFIX[self.lm_head]
            + ("" if self.lora_rank is None else f"_lora{self.lora_rank}")
            + ("" if self.recompute == "none" else f"_recompute-{self.recompute}")
            + ("_optoffload" if self.optimizer_offload else "")
            + ("" if self.engine_ranks == 0 else f"_engineranks{self.engine_ranks}")
            + ("" if self.max_staleness == 0 else f"_stale{self.max_staleness}")
        )

    def model_section(self, model_path: Path, dtype: str) -> dict:
        """The run config's ``model`` section."""
        model: dict = {
            "path": str(model_path),
            "dtype": dtype,
            "packed_attention": self.packed_attention,
            "lm_head": self.lm_head,
        }
        if self.lora_rank is not None:
            model["lora"] = {"rank": self.lora_rank, "alpha": 2.0 * self.lora_rank}
        return model

    def engine_memory(self, backend: str) -> str:
        """How the engine's memory was sized, for the JSON."""
        if backend not in BENCH_SERVER_ARGS:
            return f"{backend}: static KV cache sized to the batch (prompts x samples x (prompt_len + new_tokens))"
        fraction = SGLANG_SERVER_ARGS["mem_fraction_static"] if self.offload else RESIDENT_SGLANG_MEM_FRACTION
        return f"sglang mem_fraction_static {fraction}"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step as the loop logged it."""

    step: int
    step_s: float
    wall_s: float
    """``time/wall_step_s``: rank 0's wall clock from the previous step's record to this one, which the phases
    (``step_s``) should nearly cover."""
    phases_s: dict[str, float]
    """``time/<phase>_s`` of the step; they add up to ``step_s`` (the loop's PhaseTimer sums them)."""
    output_tokens: int
    tokens_per_s: float
    """Output tokens / step seconds."""
    rollout_tokens_per_s: float
    """Output tokens / rollout seconds."""
    peak_device_gb: float
    """Largest ``memory/<phase>/device_gb`` of the step (whole device, engine included; 0 on CPU)."""
    trainer_max_allocated_gb: float
    """torch.cuda.max_memory_allocated of the trainer process over the step (0 on CPU)."""
    trainer_rollout_gb: float
    """``memory/rollout/trainer_gb``: the trainer process's GPU memory at the end of rollout, CUDA context included;
    with offload, what stays resident while the engine generates (0 on CPU)."""
    offload: dict[str, float]
    """The step's ``offload/*`` metrics without the prefix (rlrun/trainer/offload.py: ``trainer_{sleep,wake}_{s,gb}``,
    ``trainer_{gc,pause,resume,empty_cache}_s``, ``nccl_{destroy,rebuild}_s``, ``nccl_groups_{destroyed,rebuilt}``,
    ``nccl_one_rank_groups_with_communicator``, ``engine_{release,resume_weights,resume_kv}_s``); on CPU only the
    engine's."""
    logprob_gap: float | None = None
    """``train/logprob_gap``: how far the trainer's log-probs of the step's samples are from the engine's (nats a token;
    docs/on_policy.md), so a benchmark at a model's real shapes also says whether its engine is on-policy there."""
    profiled: bool = False
    """Recorded by the torch profiler (slower): left out of the medians."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One backend's ``bench step`` run: settings, every step, medians after warm-up, environment."""

    settings: StepSettings
    variant: Variant
    label: str
    engine_memory: str
    ranks: int
    samples_per_rank: int
    """Responses each rank generates and trains on per step (``prompts`` x ``samples`` / ``ranks``)."""
    hardware: str
    dtype: str
    versions: dict[str, str]
    fixed_length: bool
    """Every response of every step had exactly ``new_tokens`` tokens."""
    warmup_steps: int
    median_step_s: float
    median_wall_s: float
    """The median of the same steps' ``wall_s``."""
    median_phases_s: dict[str, float]
    median_tokens_per_s: float
    median_offload: dict[str, float]
    peak_device_gb: float
    trainer_max_allocated_gb: float
    trainer_rollout_gb: float
    """The largest step's ``trainer_rollout_gb``: the trainer's residual memory while the engine generates."""
    max_logprob_gap: float | None
    """The largest step's ``logprob_gap`` (None where the loop logged none)."""
    steps: list[StepRecord]
    run_dir: str
    profile: PhaseProfile | None = None
    """With ``--profile-step``: the top ops of that step's train phase."""


def even_fraction(ids: list[int]) -> float:
    """Fraction of even token ids: a reward a random model scores with spread within every group."""
    return sum(1 for i in ids if i % 2 == 0) / max(len(ids), 1)


def even_token_reward(sample) -> float:
    """``rollout.reward`` of the benchmark runs."""
    return even_fraction(sample.response_ids)


def write_word_tokenizer(out_dir: Path, vocab: int) -> None:
    """A WordLevel tokenizer over ``vocab`` ids saved to ``out_dir`` (module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<pad>", unk_token="<pad>"
    ).save_pretrained(out_dir)


def prompt_rows(settings: StepSettings, vocab: int) -> list[dict[str, str]]:
    """``settings.prompts`` prompts of ``settings.prompt_len`` random words, seeded."""
    import random

    rng = random.Random(settings.seed)
    return [
        {"prompt": " ".join(f"w{rng.randrange(2, vocab)}" for _ in range(settings.prompt_len))}
        for _ in range(settings.prompts)
    ]


def _write_inputs(settings: StepSettings, inputs_dir: Path, dtype: str, device: str) -> None:
    import torch

    from rlrun.tools.bench.shapes import write_random_model

    spec = get_shape(settings.shape)
    torch.manual_seed(settings.seed)
    write_random_model(spec, inputs_dir / "model", getattr(torch, dtype), device)
    write_word_tokenizer(inputs_dir / "model", spec.vocab)
    rows = prompt_rows(settings, spec.vocab)
    (inputs_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare_inputs(settings: StepSettings, work_dir: Path, dtype: str, device: str) -> Path:
    """``work_dir/inputs`` with ``model/`` and ``prompts.jsonl`` for these settings, written unless an
    earlier run left the same ones. Written in a child process, so this process never holds GPU memory."""
    inputs_dir = work_dir / INPUTS
    key = {
        "shape": settings.shape,
        "prompts": settings.prompts,
        "prompt_len": settings.prompt_len,
        "seed": settings.seed,
        "dtype": dtype,
    }
    marker = inputs_dir / "inputs.json"
    if marker.exists() and json.loads(marker.read_text()) == key:
        return inputs_dir
    inputs_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    child = multiprocessing.get_context("spawn").Process(
        target=_write_inputs, args=(settings, inputs_dir, dtype, device)
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"writing the benchmark inputs into {inputs_dir} failed (exit {child.exitcode})")
    marker.write_text(json.dumps(key))
    return inputs_dir


def run_config(
    settings: StepSettings,
    inputs_dir: Path,
    run_dir: Path,
    dtype: str,
    variant: Variant = Variant(),
    profile_step: int | None = None,
) -> dict:
    """The ``rlrun train`` config of one run (written next to its metrics as ``bench_step.yaml``)."""
    engine: dict = {"backend": settings.backend, "startup_timeout_s": 600}
    if settings.backend in BENCH_SERVER_ARGS:
        engine["server_args"] = dict(BENCH_SERVER_ARGS[settings.backend])
        if not variant.offload:
            engine["server_args"]["mem_fraction_static"] = RESIDENT_SGLANG_MEM_FRACTION
    sample_len = settings.prompt_len + settings.new_tokens
    return {
        "model": variant.model_section(inputs_dir / "model", dtype),
        "data": {
            "path": str(inputs_dir / "prompts.jsonl"),
            "prompt_key": "prompt",
            "label_key": None,
            "apply_chat_template": False,
            "shuffle": True,
        },
        "rollout": {
            "prompts_per_step": settings.prompts,
            "samples_per_prompt": settings.samples,
            "max_new_tokens": settings.new_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "reward": f"{__name__}:even_token_reward",
            "ignore_eos": True,
            "max_staleness": variant.max_staleness,
        },
        "placement": {"engine_ranks": variant.engine_ranks},
        "engine": engine,
        "offload": {
            "train": variant.offload,
            "rollout": variant.offload,
            "teardown_nccl": variant.teardown_nccl,
            "release_cache": variant.release_cache,
            "optimizer_copy": variant.optimizer_copy,
        },
        "algorithm": {"advantage_estimator": "grpo", "normalize_std": True, "eps_clip": 0.2, "skip_tied_groups": False},
        "optimizer": {
            "lr": settings.lr,
            "clip_grad": 1.0,
            "cpu_offload": variant.optimizer_offload,
            "use_distributed_optimizer": variant.optimizer_offload,
        },
        "train": {
            "recompute": variant.recompute,
            "num_steps": settings.steps,
            "seed": settings.seed,
            "updates_per_rollout": settings.updates_per_rollout,
            "max_tokens_per_micro_batch": settings.micro_batch_samples * sample_len,
        },
        "checkpoint": {"save_interval": 0, "resume": "none", "save_at_end": False, "export_at_end": False},
        "logging": {
            "run_dir": str(run_dir),
            "console": True,
            "profile_steps": [] if profile_step is None else [profile_step],
        },
    }


def launch(config_path: Path, run_dir: Path, timeout_s: float, ranks: int = 1) -> None:
    """``torchrun --nproc-per-node RANKS -m rlrun train CONFIG``, output in ``run_dir/torchrun.log``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "rlrun",
        "train",
        str(config_path),
    ]
    repo = str(Path(__file__).resolve().parents[3])  # rlrun/tools/bench/step.py -> the repository
    env = {
        **TORCHRUN_ENV,
        **os.environ,  # what the caller set wins (OMP_NUM_THREADS=1 on a shared CPU)
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    log = run_dir / "torchrun.log"
    code = run_logged(cmd, log, timeout_s, env=env)
    if code != 0:
        raise RuntimeError(
            f"rlrun train ({config_path}) must exit 0 but ended with {code}; its output "
            f"({log}) ends with:\n{log.read_text()[-3000:]}"
        )


def step_record(row: dict, settings: StepSettings, profile_step: int | None = None) -> StepRecord:
    """One metrics.jsonl row as a :class:`StepRecord`."""
    phases = {
        key[len("time/") : -len("_s")]: value
        for key, value in row.items()
        if key.startswith("time/") and key.endswith("_s") and key not in STEP_TOTALS
    }
    tokens = round(row["rollout/response_len_mean"] * settings.prompts * settings.samples)
    device_gb = [v for k, v in row.items() if k.startswith("memory/") and k.endswith("/device_gb")]
    return StepRecord(
        step=row["step"],
        step_s=row[STEP_SECONDS],
        wall_s=row[WALL_STEP_SECONDS],
        phases_s=phases,
        output_tokens=tokens,
        tokens_per_s=tokens / row[STEP_SECONDS],
        rollout_tokens_per_s=tokens / phases["rollout"],
        peak_device_gb=max(device_gb, default=0.0),
        trainer_max_allocated_gb=row.get("memory/trainer_max_allocated_gb", 0.0),
        trainer_rollout_gb=row.get("memory/rollout/trainer_gb", 0.0),
        offload={k[len("offload/") :]: v for k, v in row.items() if k.startswith("offload/")},
        logprob_gap=row.get("train/logprob_gap"),
        profiled=row["step"] == profile_step,
    )


def summarise(
    rows: list[dict],
    settings: StepSettings,
    hardware: str,
    dtype: str,
    run_dir: Path,
    variant: Variant = Variant(),
    profile: PhaseProfile | None = None,
    ranks: int = 1,
) -> StepResult:
    """Per-step records and medians over the steps after ``WARMUP_STEPS`` (all steps if there are no more),
    leaving out the profiled step."""
    if len(rows) != settings.steps:
        raise RuntimeError(
            f"metrics.jsonl in {run_dir} has {len(rows)} steps but the run was set to "
            f"{settings.steps}; see {run_dir / 'torchrun.log'}"
        )
    records = [step_record(row, settings, profile.step if profile else None) for row in rows]
    warmup = WARMUP_STEPS if len(records) > WARMUP_STEPS else 0
    timed = [r for r in records[warmup:] if not r.profiled] or records[warmup:]
    phases = sorted({p for r in timed for p in r.phases_s})
    offload_keys = sorted({k for r in timed for k in r.offload})
    expected = settings.prompts * settings.samples * settings.new_tokens
    return StepResult(
        settings=settings,
        variant=variant,
        label=run_dir.name,
        engine_memory=variant.engine_memory(settings.backend),
        ranks=ranks,
        samples_per_rank=settings.prompts * settings.samples // ranks,
        hardware=hardware,
        dtype=dtype,
        versions=versions(settings.backend),
        fixed_length=all(r.output_tokens == expected for r in records),
        warmup_steps=warmup,
        median_step_s=statistics.median(r.step_s for r in timed),
        median_wall_s=statistics.median(r.wall_s for r in timed),
        median_phases_s={p: statistics.median(r.phases_s.get(p, 0.0) for r in timed) for p in phases},
        median_tokens_per_s=statistics.median(r.tokens_per_s for r in timed),
        median_offload={k: statistics.median(r.offload[k] for r in timed if k in r.offload) for k in offload_keys},
        peak_device_gb=max(r.peak_device_gb for r in records),
        trainer_max_allocated_gb=max(r.trainer_max_allocated_gb for r in records),
        trainer_rollout_gb=max(r.trainer_rollout_gb for r in records),
        max_logprob_gap=max((r.logprob_gap for r in records if r.logprob_gap is not None), default=None),
        steps=records,
        run_dir=str(run_dir),
        profile=profile,
    )


def versions(backend: str) -> dict[str, str]:
    """Installed versions of what the run's figures depend on."""
    package = backend_traits(backend).package
    names = ["torch", "transformers", "megatron-core"] + ([package] if package else [])
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def device_name() -> str:
    """The GPU's name (``cpu`` without one); asked only after the run, so no CUDA context is held during it."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def bench_step(
    settings: StepSettings,
    work_dir: Path,
    timeout_s: float = 1800.0,
    variant: Variant = Variant(),
    profile_step: int | None = None,
    ranks: int = 1,
) -> StepResult:
    """Run ``settings.steps`` GRPO steps with ``settings.backend`` as ``variant`` says and summarise the
    loop's metrics; with ``profile_step``, also that step's train-phase ops. With ``ranks`` > 1, torchrun
    starts that many ranks (DP=ranks, an engine each), which share ``settings.prompts``: for weak scaling
    pass ``ranks`` times the one-rank prompts (scripts/gpu/multi_gpu.sh does)."""
    if settings.prompts % ranks:
        raise ValueError(
            f"prompts ({settings.prompts}) must be a multiple of ranks ({ranks}) because every rank "
            f"generates and trains on the same share; set prompts to {ranks} x the prompts per rank"
        )
    if profile_step is not None and not 0 <= profile_step < settings.steps:
        raise ValueError(
            f"--profile-step ({profile_step}) must be one of the run's steps 0..{settings.steps - 1} "
            f"because only those run; set it to {settings.steps - 1} (the last) or raise --steps"
        )
    import torch

    from rlrun.config import load_config

    on_gpu = torch.cuda.is_available()
    dtype = "bfloat16" if on_gpu else "float32"
    base = settings.backend + ("" if ranks == 1 else f"_ranks{ranks}")
    base += "" if settings.updates_per_rollout == 1 else f"_updates{settings.updates_per_rollout}"
    run_dir = work_dir / variant.label(base)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    config_path = run_dir / "bench_step.yaml"
    config = run_config(settings, work_dir / INPUTS, run_dir, dtype, variant, profile_step)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    load_config(config_path)  # a bad setting (backend, steps, ...) fails here, before any model is written
    prepare_inputs(settings, work_dir, dtype, "cuda" if on_gpu else "cpu")
    launch(config_path, run_dir, timeout_s, ranks + variant.engine_ranks)  # the engine ranks come last
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    profile = None
    if profile_step is not None:
        from rlrun.observability.profiler import trace_path

        profile = phase_profile(trace_path(run_dir, profile_step, 0), PROFILED_PHASE, profile_step)
    return summarise(rows, settings, device_name(), dtype, run_dir, variant, profile, ranks)
