"""TRL's GRPOTrainer (transformers generate, no vLLM) on the inputs of ``rlrun bench step``: seconds per step.

Same model directory and prompts (``rlrun.bench.step.prepare_inputs``: a random-init model of the shape
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

Timing: a step is the optimizer step as the trainer's callbacks see it (``on_step_begin`` ..
``on_step_end``, CUDA synchronised); ``generate`` is ``_generate_single_turn`` (transformers generate),
``score`` is the rest of ``_generate_and_score_completions`` (decode, reward, advantages), ``train`` the
remainder (forward/backward of every micro-batch and the optimizer). Medians leave out the warm-up steps
(``rlrun.bench.step.WARMUP_STEPS``, as rlrun's runs do).

    python benchmarks/trl_grpo.py --work runs/bench_step --shape qwen3-0.6b --steps 5 --out trl.json

Needs trl 1.16 (and datasets); on the GPU machine they travel as wheels: scripts/gpu/trl_session.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rlrun.bench.step import WARMUP_STEPS, StepSettings, even_fraction, prepare_inputs  # noqa: E402


@dataclasses.dataclass
class StepClock:
    """Seconds of the current step's phases, and every finished step's record."""

    on_gpu: bool
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    records: list[dict] = dataclasses.field(default_factory=list)
    started: float = 0.0

    def now(self) -> float:
        if self.on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        start = self.now()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + self.now() - start


def make_trainer(settings: StepSettings, inputs_dir: Path, out_dir: Path, clock: StepClock, checkpointing: bool):
    """A GRPOTrainer whose generation and scoring report to ``clock`` (TRL 1.16 method names)."""
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    for name in ("_generate_single_turn", "_generate_and_score_completions"):
        if not hasattr(GRPOTrainer, name):
            raise RuntimeError(
                f"trl {importlib.metadata.version('trl')} GRPOTrainer has no {name}, which this "
                "script times; install trl 1.16 (scripts/gpu/trl_session.md)"
            )

    class TimedGRPOTrainer(GRPOTrainer):
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

    batch = settings.prompts * settings.samples
    on_gpu = clock.on_gpu
    config = GRPOConfig(
        output_dir=str(out_dir),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.micro_batch_samples,
        gradient_accumulation_steps=batch // settings.micro_batch_samples,
        num_generations=settings.samples,
        max_completion_length=settings.new_tokens,
        generation_kwargs={"min_new_tokens": settings.new_tokens},
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
    )
    dataset = load_dataset("json", data_files=str(inputs_dir / "prompts.jsonl"), split="train")
    return TimedGRPOTrainer(
        model=str(inputs_dir / "model"), reward_funcs=reward, args=config, train_dataset=dataset, callbacks=[Steps()]
    )


def step_record(clock: StepClock, step_s: float) -> dict:
    """One step's seconds by phase and peak memory (GiB, as torch.cuda reports it)."""
    generate = clock.phases.get("generate", 0.0)
    prepared = clock.phases.get("generate_and_score", 0.0)
    gib = 2**30
    return {
        "step_s": step_s,
        "phases_s": {"generate": generate, "score": prepared - generate, "train": step_s - prepared},
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


def versions() -> dict[str, str]:
    return {
        name: importlib.metadata.version(name) for name in ("torch", "transformers", "trl", "accelerate", "datasets")
    }


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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    return settings_from(args, "trl"), args


def main(argv: list[str] | None = None) -> dict:
    settings, args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    inputs_dir = prepare_inputs(settings, args.work, "bfloat16" if on_gpu else "float32", "cuda" if on_gpu else "cpu")
    clock = StepClock(on_gpu=on_gpu)
    trainer = make_trainer(settings, inputs_dir, args.work / "trl", clock, args.gradient_checkpointing)
    trainer.train()
    extra = {"gradient_checkpointing": args.gradient_checkpointing, **summarise(settings, clock.records)}
    return write_result("trl_grpo", settings, versions(), extra, args.out)


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
