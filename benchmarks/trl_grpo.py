"""TRL's GRPOTrainer (transformers generate, or vLLM colocated) on the inputs of ``rlrun bench step``: seconds per step.

Same model directory and prompts (``rlrun.tools.bench.step.prepare_inputs``: a random-init model of the shape
with a WordLevel tokenizer over its vocabulary, ``prompts`` rows of ``prompt_len`` words), same group size
(``num_generations`` = samples), same fixed response length (``min_new_tokens`` = ``max_completion_length``
= new_tokens, so EOS cannot end a response), same sampling (temperature 1, no top-k/top-p), learning rate,
Adam settings and batch (``prompts x samples`` completions per optimizer step, micro-batches of
``micro_batch_samples``), the same reward (``even_fraction`` of the completion ids), GRPO without a
reference model (beta 0), token-level loss (``dapo``, rlrun's ``loss_aggregation: token``).
Gradient checkpointing is off unless ``--gradient-checkpointing`` (TRL's default is on; rlrun does not
recompute), so both sides do the same FLOPs. On GPU the model loads in bf16 and TRL trains those weights
directly, as TRL's recipes do; rlrun's Megatron optimizer keeps fp32 main weights (more memory, the same
matmuls).

``--use-vllm``: TRL generates with vLLM in colocate mode (``use_vllm=True, vllm_mode="colocate"``: an
in-process ``vllm.LLM`` on the trainer's GPU, weights pushed from the training model before each step's
rollout), its sampler held to the same work: ``min_tokens`` = new_tokens (vLLM's name for
``min_new_tokens``), ``vllm_max_model_length`` = prompt + response. ``--offload on`` turns on vLLM's sleep
mode (level 2: weights and KV cache freed after each rollout, weights re-pushed at the next), vLLM taking
0.3 of the device; ``off`` keeps it resident at 0.15: the SGLang fractions of rlrun's two rows
(rlrun.tools.bench.step). TRL's default importance-sampling correction recomputes the old log-probs with the
training model (an extra forward rlrun and the transformers mode do not run); it is off unless
``--vllm-is-correction``, so all sides do the same work.

Timing: a step is the optimizer step as the trainer's callbacks see it (``on_step_begin`` ..
``on_step_end``, CUDA synchronised); ``generate`` is ``_generate_single_turn`` (transformers generate),
``score`` is the rest of ``_generate_and_score_completions`` (decode, reward, advantages), ``train`` the
remainder (forward/backward of every micro-batch and the optimizer). With vLLM, ``sync_weights`` (the push of
the training weights into vLLM) and ``offload`` (vLLM's sleep and wake-ups) are phases of their own; every
phase counts its own seconds, without those of the phases inside it. Medians leave out the warm-up steps
(``rlrun.tools.bench.step.WARMUP_STEPS``, as rlrun's runs do).

    python benchmarks/trl_grpo.py --work runs/bench_step --shape qwen3-0.6b --steps 5 --out trl.json
    python benchmarks/trl_grpo.py --work runs/bench_step --shape qwen3-0.6b --steps 5 --use-vllm --offload on

Needs trl 1.16 (and datasets); on the GPU machine they travel as wheels: scripts/gpu/trl_session.md, and
with vLLM 0.26.0 in an environment of its own: scripts/gpu/vllm_session.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlrun.tools.bench.engines import SGLANG_SERVER_ARGS  # noqa: E402
from rlrun.tools.bench.step import (  # noqa: E402
    RESIDENT_SGLANG_MEM_FRACTION,
    WARMUP_STEPS,
    StepSettings,
    even_fraction,
    prepare_inputs,
)


@dataclasses.dataclass
class StepClock:
    """Seconds of the current step's phases, and every finished step's record. A phase counts its own
    seconds: those of a phase inside it (vLLM's wake-up inside the weight push) go to the inner one."""

    on_gpu: bool
    vllm: bool = False
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    records: list[dict] = dataclasses.field(default_factory=list)
    started: float = 0.0
    inner: list[float] = dataclasses.field(default_factory=list)
    """Per open phase, the seconds of the phases that ran inside it so far."""

    def now(self) -> float:
        if self.on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        start = self.now()
        self.inner.append(0.0)
        try:
            yield
        finally:
            total = self.now() - start
            self.phases[name] = self.phases.get(name, 0.0) + total - self.inner.pop()
            if self.inner:
                self.inner[-1] += total

    def timed(self, name: str, method):
        """``method`` wrapped to run as phase ``name``."""

        def run(*args, **kwargs):
            with self.phase(name):
                return method(*args, **kwargs)

        return run


@dataclasses.dataclass(frozen=True)
class VllmMode:
    """How TRL's colocated vLLM runs (``--use-vllm``)."""

    offload: bool
    """vLLM's sleep mode: weights and KV cache freed between rollouts (rlrun's ``--offload on`` row)."""
    is_correction: bool = False
    """TRL's importance-sampling correction (an extra forward of the training model per rollout)."""


VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
"""Set before vLLM starts. vLLM 0.26.0's sampler imports FlashInfer at start-up to ask whether its top-k/top-p
kernel may run (``flashinfer_sampler_supported``); FlashInfer is not staged (scripts/gpu/vllm_wheels.txt), and
this workload samples with neither top-k nor top-p, which vLLM never hands to FlashInfer, so the sampler runs the
same kernels either way."""


def vllm_config(settings: StepSettings, mode: VllmMode) -> dict:
    """GRPOConfig's keys for vLLM in colocate mode (TRL 1.16 names), the device fraction as rlrun's SGLang
    engine takes it in the row with the same offload."""
    return {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_enable_sleep_mode": mode.offload,
        "vllm_gpu_memory_utilization": (
            SGLANG_SERVER_ARGS["mem_fraction_static"] if mode.offload else RESIDENT_SGLANG_MEM_FRACTION
        ),
        "vllm_max_model_length": settings.prompt_len + settings.new_tokens,
        "vllm_importance_sampling_correction": mode.is_correction,
        "generation_kwargs": {"min_tokens": settings.new_tokens},  # SamplingParams' name for min_new_tokens
    }


def grpo_config(settings: StepSettings, out_dir: Path, on_gpu: bool, checkpointing: bool, vllm: VllmMode | None):
    """The GRPOConfig of the step: the same work with transformers generation or with vLLM."""
    from trl import GRPOConfig

    batch = settings.prompts * settings.samples
    generation = {"generation_kwargs": {"min_new_tokens": settings.new_tokens}}
    return GRPOConfig(
        output_dir=str(out_dir),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.micro_batch_samples,
        gradient_accumulation_steps=batch // settings.micro_batch_samples,
        num_generations=settings.samples,
        max_completion_length=settings.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=settings.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        gradient_checkpointing=checkpointing,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        seed=settings.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        log_completions=False,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.bfloat16 if on_gpu else torch.float32, "attn_implementation": "sdpa"},
        **(generation if vllm is None else vllm_config(settings, vllm)),
    )


def make_trainer(
    settings: StepSettings,
    inputs_dir: Path,
    out_dir: Path,
    clock: StepClock,
    checkpointing: bool,
    vllm: VllmMode | None = None,
):
    """A GRPOTrainer whose generation and scoring (and with vLLM its weight push, sleep and wake-ups) report
    to ``clock`` (TRL 1.16 method names)."""
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    for name in ("_generate_single_turn", "_generate_and_score_completions"):
        if not hasattr(GRPOTrainer, name):
            raise RuntimeError(
                f"trl {importlib.metadata.version('trl')} GRPOTrainer has no {name}, which this "
                "script times; install trl 1.16 (scripts/gpu/trl_session.md)"
            )

    class TimedGRPOTrainer(GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.use_vllm:  # the first sleep (at start-up) is not a step's
                generation = self.vllm_generation
                generation.sync_weights = clock.timed("sync_weights", generation.sync_weights)
                generation.llm.sleep = clock.timed("offload", generation.llm.sleep)
                generation.llm.wake_up = clock.timed("offload", generation.llm.wake_up)

        def _generate_single_turn(self, *args, **kwargs):
            with clock.phase("generate"):
                return super()._generate_single_turn(*args, **kwargs)

        def _generate_and_score_completions(self, *args, **kwargs):
            with clock.phase("generate_and_score"):
                return super()._generate_and_score_completions(*args, **kwargs)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.phases = {}
            if clock.on_gpu:
                torch.cuda.reset_peak_memory_stats()
            clock.started = clock.now()

        def on_step_end(self, args, state, control, **kwargs):
            clock.records.append(step_record(clock, clock.now() - clock.started))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and clock.records:
                clock.records[-1]["completion_mean_length"] = logs["completions/mean_length"]

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [even_fraction(ids) for ids in completion_ids]

    config = grpo_config(settings, out_dir, clock.on_gpu, checkpointing, vllm)
    dataset = load_dataset("json", data_files=str(inputs_dir / "prompts.jsonl"), split="train")
    return TimedGRPOTrainer(
        model=str(inputs_dir / "model"), reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[Steps()]
    )


def step_record(clock: StepClock, step_s: float) -> dict:
    """One step's seconds by phase and peak memory (GiB, as torch.cuda reports it)."""
    phases = {"generate": clock.phases.get("generate", 0.0), "score": clock.phases.get("generate_and_score", 0.0)}
    if clock.vllm:
        phases |= {name: clock.phases.get(name, 0.0) for name in ("sync_weights", "offload")}
    gib = 2**30
    return {
        "step_s": step_s,
        "phases_s": {**phases, "train": step_s - sum(phases.values())},
        "max_allocated_gib": torch.cuda.max_memory_allocated() / gib if clock.on_gpu else 0.0,
        "max_reserved_gib": torch.cuda.max_memory_reserved() / gib if clock.on_gpu else 0.0,
    }


def summarise(settings: StepSettings, records: list[dict]) -> dict:
    """Per-step records with output tokens and tokens/s; medians after the warm-up steps (rlrun's)."""
    tokens = settings.prompts * settings.samples * settings.new_tokens
    for record in records:
        record["output_tokens"] = tokens
        record["tokens_per_s"] = tokens / record["step_s"]
    warmup = WARMUP_STEPS if len(records) > WARMUP_STEPS else 0
    timed = records[warmup:]
    return {
        "fixed_length": all(r.get("completion_mean_length") == settings.new_tokens for r in records),
        "warmup_steps": warmup,
        "median_step_s": statistics.median(r["step_s"] for r in timed),
        "median_phases_s": {p: statistics.median(r["phases_s"][p] for r in timed) for p in timed[0]["phases_s"]},
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "max_allocated_gib": max(r["max_allocated_gib"] for r in records),
        "max_reserved_gib": max(r["max_reserved_gib"] for r in records),
        "steps": records,
    }


def versions(vllm: bool = False) -> dict[str, str]:
    names = ("torch", "transformers", "trl", "accelerate", "datasets") + (("vllm",) if vllm else ())
    return {name: importlib.metadata.version(name) for name in names}


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`StepSettings` field (the names ``rlrun bench step`` takes), with its default."""
    defaults = StepSettings()
    for field in dataclasses.fields(StepSettings):
        if field.name != "backend":
            parser.add_argument(
                "--" + field.name.replace("_", "-"),
                type=type(getattr(defaults, field.name)),
                default=getattr(defaults, field.name),
            )
    parser.add_argument(
        "--work", type=Path, default=Path("runs/bench_step"), help="Inputs shared with rlrun bench step."
    )


def settings_from(args: argparse.Namespace, backend: str) -> StepSettings:
    settings = StepSettings(
        backend=backend,
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(StepSettings) if f.name != "backend"},
    )
    if (settings.prompts * settings.samples) % settings.micro_batch_samples:
        raise SystemExit(
            f"--micro-batch-samples ({settings.micro_batch_samples}) must divide prompts x samples "
            f"({settings.prompts * settings.samples}) because TRL accumulates whole micro-batches"
        )
    return settings


def parse_args(argv: list[str] | None = None) -> tuple[StepSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_settings_args(parser)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--use-vllm", action="store_true", help="Generate with vLLM in colocate mode.")
    parser.add_argument(
        "--offload", choices=("on", "off"), help="With --use-vllm: vLLM's sleep mode on (default) or off."
    )
    parser.add_argument(
        "--vllm-is-correction",
        action="store_true",
        help="With --use-vllm: TRL's importance-sampling correction (recomputes old log-probs; off by default).",
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="Only build the GRPOConfig (CPU flags; no model, no vLLM) and print its generation keys.",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.use_vllm and (args.offload is not None or args.vllm_is_correction):
        raise SystemExit(
            "--offload / --vllm-is-correction must come with --use-vllm because they configure TRL's vLLM; "
            "add --use-vllm or drop them"
        )
    return settings_from(args, "trl"), args


def vllm_mode(args: argparse.Namespace) -> VllmMode | None:
    if not args.use_vllm:
        return None
    return VllmMode(offload=args.offload != "off", is_correction=args.vllm_is_correction)


def main(argv: list[str] | None = None) -> dict:
    settings, args = parse_args(argv)
    vllm = vllm_mode(args)
    run_dir = args.work / ("trl" if vllm is None else "trl_vllm" if vllm.offload else "trl_vllm_resident")
    if args.check_config:
        config = grpo_config(settings, run_dir, False, args.gradient_checkpointing, vllm)
        keys = sorted(k for k in vars(config) if k.startswith("vllm") or k in ("use_vllm", "generation_kwargs"))
        print(json.dumps({k: getattr(config, k) for k in keys}, indent=2, default=str))
        return {}
    on_gpu = torch.cuda.is_available()
    if vllm is not None and not on_gpu:
        raise SystemExit("--use-vllm needs a CUDA device because vLLM's colocate mode runs on the GPU; drop it")
    if vllm is not None:
        for key, value in VLLM_ENV.items():
            os.environ.setdefault(key, value)
    inputs_dir = prepare_inputs(settings, args.work, "bfloat16" if on_gpu else "float32", "cuda" if on_gpu else "cpu")
    clock = StepClock(on_gpu=on_gpu, vllm=vllm is not None)
    trainer = make_trainer(settings, inputs_dir, run_dir, clock, args.gradient_checkpointing, vllm)
    trainer.train()
    extra = {"gradient_checkpointing": args.gradient_checkpointing, **summarise(settings, clock.records)}
    if vllm is not None:
        env = {key: os.environ[key] for key in VLLM_ENV}
        extra["vllm"] = dataclasses.asdict(vllm) | vllm_config(settings, vllm) | {"env": env}
    name = "trl_grpo" if vllm is None else "trl_grpo_vllm"
    return write_result(name, settings, versions(vllm is not None), extra, args.out)


def write_result(benchmark: str, settings: StepSettings, versions: dict, extra: dict, out: Path | None) -> dict:
    """A peer run's JSON record (the fields ``peer_step.py`` reads), printed and written to ``out``."""
    result = {
        "benchmark": benchmark,
        "command": "python " + " ".join(sys.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "versions": versions,
        "settings": dataclasses.asdict(settings),
        **extra,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
