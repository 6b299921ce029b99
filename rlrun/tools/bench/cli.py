"""``rlrun bench rollout``, ``sync``, ``train`` and ``step``: run a benchmark, print its JSON, optionally save it.

The JSON records the command line and the UTC date next to the figures, so a committed result says
how it was produced. torch and the benchmark modules are imported only when a command runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Annotated, Any, get_args

import typer

bench_app = typer.Typer(
    no_args_is_help=True, help="GPU benchmarks: rollout throughput, weight sync and training throughput."
)
OutFile = Annotated[Path | None, typer.Option("--out", help="Also write the JSON to this file.")]


def _emit(kind: str, results: Any, out: Path | None, echo: bool = True) -> None:
    import torch
    import transformers

    record = {
        "benchmark": kind,
        "command": "rlrun " + " ".join(sys.argv[1:]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": [dataclasses.asdict(r) for r in results],
    }
    text = json.dumps(record, indent=2)
    if echo:
        typer.echo(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


@bench_app.command("rollout")
def rollout(
    shape: Annotated[
        str,
        typer.Option(help="qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b or tiny; comma-separated for several, in order."),
    ] = "qwen3-0.6b",
    batch: Annotated[str, typer.Option(help="Rows decoded at once; comma-separated for several, e.g. 64,128.")] = "64",
    prompt_len: int = 128,
    new_tokens: int = 256,
    device: Annotated[str | None, typer.Option(help="Default: cuda if available, else cpu.")] = None,
    dtype: Annotated[str | None, typer.Option(help="Default: bfloat16 on cuda, float32 on cpu.")] = None,
    hbm_gbps: Annotated[
        float | None,
        typer.Option(
            help="HBM bandwidth for the bound, GB/s; default: the card's (H200 4800, H100 SXM 3350). Needed on CPU."
        ),
    ] = None,
    backends: Annotated[
        str | None,
        typer.Option(
            help=(
                "Comma-separated engine backends (embedded, sglang; embedded_chunked / embedded_efficient: the "
                "embedded engine on the chunked / memory-efficient kernels, as with model.packed_attention "
                "chunked_varlen / efficient_varlen; embedded alone runs auto's) to compare through rlrun's engine "
                "worker, same weights and prompts; without it: the in-process embedded engine vs HF generate."
            )
        ),
    ] = None,
    run_dir: Annotated[Path, typer.Option(help="With --backends: engine logs and the model directory.")] = Path(
        "runs/bench"
    ),
    long_tail: Annotated[
        bool,
        typer.Option(
            help="With --backends: also a long-tail call (requests-per-slot x batch prompts, lognormal lengths, EOS)."
        ),
    ] = False,
    long_tail_requests_per_slot: int = 4,
    long_tail_median: Annotated[int, typer.Option(help="Median of the drawn max_new_tokens.")] = 128,
    long_tail_sigma: Annotated[float, typer.Option(help="Sigma of log(max_new_tokens).")] = 1.0,
    long_tail_max: Annotated[int, typer.Option(help="Cap of the drawn max_new_tokens.")] = 1024,
    profile: Annotated[
        Path | None,
        typer.Option(
            help=(
                "Embedded engine only: profile decode steps of the sampled call, write the kernel-time table here "
                "(<stem>_b<batch> for several batch sizes) and the step's breakdown into the JSON (decode_profile)."
            )
        ),
    ] = None,
    out: OutFile = None,
) -> None:
    """Embedded engine vs transformers generate output tokens/s, and the memory-bandwidth bound."""
    import torch

    from rlrun.tools.bench.rollout import bench_rollout

    shapes = _shape_names(shape)
    if profile is not None and len(shapes) > 1:
        raise typer.BadParameter(
            f"--profile ({profile}) takes one --shape, not {len(shapes)} ({shape}), because its tables are named by "
            "batch only; profile one shape a run"
        )
    batches = _positive_ints("--batch", batch)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if backends:
        from rlrun.tools.bench.engines import LongTail, bench_rollout_backends

        names = [b.strip() for b in backends.split(",") if b.strip()]
        workload = (
            LongTail(long_tail_requests_per_slot, long_tail_median, long_tail_sigma, long_tail_max)
            if long_tail
            else None
        )
        results = []
        for one in shapes:  # the file grows shape by shape: a stopped run keeps the shapes it finished
            try:
                results += bench_rollout_backends(
                    names,
                    one,
                    batches,
                    prompt_len,
                    new_tokens,
                    dtype,
                    run_dir,
                    hbm_bytes_per_s=None if hbm_gbps is None else hbm_gbps * 1e9,
                    long_tail=workload,
                    profile=profile,
                )
            except ValueError as exc:  # options that cannot run together (--profile with SGLang), an unknown card
                raise typer.BadParameter(str(exc)) from None
            _emit("rollout", results, out, echo=one == shapes[-1])
        return
    if long_tail:
        raise typer.BadParameter(
            "--long-tail needs --backends because it runs through the engine worker (max_running_requests); "
            "add --backends embedded"
        )
    from rlrun.tools.bench.rollout import profile_path

    try:
        results = [
            bench_rollout(
                one,
                b,
                prompt_len,
                new_tokens,
                device,
                dtype,
                hbm_bytes_per_s=None if hbm_gbps is None else hbm_gbps * 1e9,
                profile=None if profile is None else profile_path(profile, b, batches),
            )
            for one in shapes
            for b in batches
        ]
    except ValueError as exc:  # a card whose bandwidth is not known, without --hbm-gbps (checked before the model)
        raise typer.BadParameter(str(exc)) from None
    _emit("rollout", results, out)


def _shape_names(value: str) -> list[str]:
    """``qwen3-0.6b,1.7b`` as its shapes' names, each one the benchmarks know, none twice (in either spelling)."""
    from rlrun.tools.bench.shapes import get_shape

    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise typer.BadParameter(f"--shape ({value!r}) names no shape; set e.g. --shape qwen3-0.6b,qwen3-1.7b")
    try:
        shapes = [get_shape(name) for name in names]
    except ValueError as exc:
        raise typer.BadParameter(f"--shape: {exc}") from None
    twice = sorted({n for n, s in zip(names, shapes, strict=True) if shapes.count(s) > 1})
    if twice:
        raise typer.BadParameter(f"--shape ({value}) names {', '.join(twice)} twice; name each shape once")
    return names


def _positive_ints(flag: str, value: str) -> list[int]:
    """``64,128`` as [64, 128]."""
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        raise typer.BadParameter(f"{flag} ({value}) must be positive integers, comma-separated; set e.g. {flag} 64,128")
    return numbers


@bench_app.command("sync")
def sync(
    shape: Annotated[str, typer.Option(help="Comma-separated shapes, e.g. qwen3-0.6b,1.7b,4b,8b.")] = "qwen3-0.6b",
    bucket_mib: int = 512,
    repeats: int = 3,
    run_dir: Annotated[Path, typer.Option(help="Engine logs and temporary model directories.")] = Path("runs/bench"),
    backends: Annotated[str, typer.Option(help="Comma-separated engine backends: embedded, sglang.")] = "embedded",
    out: OutFile = None,
) -> None:
    """Megatron -> embedded engine weight sync: seconds and GB/s per shape (median of REPEATS after a warm-up)."""
    from rlrun.tools.bench.sync import bench_sync

    shapes = _shape_names(shape)
    names = tuple(b.strip() for b in backends.split(",") if b.strip())
    results = []
    for result in bench_sync(shapes, run_dir, bucket_bytes=bucket_mib * 2**20, repeats=repeats, backends=names):
        results.append(result)
        _emit("sync", results, out, echo=len(results) == len(shapes) * len(names))  # the file grows run by run


@bench_app.command("train")
def train(
    shape: Annotated[str, typer.Option(help="qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b or tiny.")] = "qwen3-1.7b",
    layout: Annotated[str, typer.Option(help="Comma-separated: packed (samples share a row), rows.")] = "packed",
    sample_len: int = 4096,
    samples_per_micro_batch: int = 4,
    micro_batches: int = 4,
    steps: int = 3,
    peak_tflops: Annotated[float, typer.Option(help="Peak bf16 TFLOP/s for MFU (H200: 790).")] = 790.0,
    profile: Annotated[Path | None, typer.Option(help="Write one step's kernel-time table here.")] = None,
    recompute: Annotated[str, typer.Option(help="train.recompute: none, selective or full.")] = "none",
    recompute_num_layers: Annotated[
        int | None, typer.Option(help="train.recompute_num_layers (full only; default every layer).")
    ] = None,
    lm_head: Annotated[str, typer.Option(help="model.lm_head: chunked, chunked_kept or logits.")] = "chunked",
    optimizer_offload: Annotated[
        str, typer.Option(help="on|off: optimizer.cpu_offload (Adam state on the host; CUDA only).")
    ] = "off",
    offload_fraction: Annotated[
        float, typer.Option(help="optimizer.offload_fraction: share of the parameters whose state goes to the host.")
    ] = 1.0,
    packed_attention: Annotated[
        str,
        typer.Option(
            help="auto, per_sample, efficient_varlen (CUDA), chunked_varlen, flash_varlen or cudnn_per_sample "
            "(CUDA, bf16): model.packed_attention."
        ),
    ] = "auto",
    out: OutFile = None,
) -> None:
    """Megatron training tokens/s, TFLOP/s, MFU and peak memory (formula in rlrun/tools/bench/train.py)."""
    from rlrun.tools.bench.train import bench_train

    layouts = [name.strip() for name in layout.split(",") if name.strip()]
    offload = _on_off("--optimizer-offload", optimizer_offload)
    memory = _memory_options(recompute, recompute_num_layers, lm_head, offload, offload_fraction)
    try:
        results = bench_train(
            shape,
            layouts,
            sample_len,
            samples_per_micro_batch,
            micro_batches,
            steps,
            peak_tflops,
            profile,
            memory,
            packed_attention,
        )
    except ValueError as exc:  # options that cannot run here (offload on CPU, too many recompute layers, flash on CPU)
        raise typer.BadParameter(str(exc)) from None
    _emit("train", results, out)


def _memory_options(recompute: str, num_layers: int | None, lm_head: str, offload: bool = False, fraction: float = 1.0):
    """``bench train``'s memory flags checked by the run config's own schema (same values, same errors)."""
    from pydantic import ValidationError

    from rlrun.config.schema import ModelConfig, OptimizerConfig, TrainConfig
    from rlrun.tools.bench.train import MemoryOptions

    try:
        train = TrainConfig(recompute=recompute, recompute_num_layers=num_layers)
        model = ModelConfig(path="unused", lm_head=lm_head)  # only lm_head is checked here
        opt = OptimizerConfig(cpu_offload=offload, use_distributed_optimizer=offload, offload_fraction=fraction)
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None
    return MemoryOptions(
        train.recompute, train.recompute_num_layers, model.lm_head, opt.cpu_offload, opt.offload_fraction
    )


@bench_app.command("step")
def step(
    shape: Annotated[str, typer.Option(help="qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b or tiny.")] = "qwen3-0.6b",
    backend: Annotated[str, typer.Option(help="Engine backend: embedded or sglang.")] = "embedded",
    prompts: int = 16,
    samples: Annotated[int, typer.Option(help="Responses per prompt (GRPO group).")] = 8,
    prompt_len: int = 128,
    new_tokens: Annotated[int, typer.Option(help="Every response's length (EOS ignored).")] = 512,
    steps: int = 5,
    micro_batch_samples: int = 32,
    lr: float = 1e-6,
    seed: int = 0,
    updates_per_rollout: Annotated[
        int, typer.Option(help="train.updates_per_rollout: optimizer steps per rollout (PPO-style minibatches).")
    ] = 1,
    work: Annotated[
        Path, typer.Option(help="Model, prompts (shared across runs) and each backend's run directory.")
    ] = Path("runs/bench_step"),
    timeout_s: float = 1800.0,
    offload: Annotated[
        str, typer.Option(help="on: trainer and engine take turns on the device; off: both resident (as TRL).")
    ] = "on",
    teardown_nccl: Annotated[str, typer.Option(help="on|off: offload.teardown_nccl (only with --offload on).")] = "on",
    release_cache: Annotated[
        str, typer.Option(help="when_needed|always: offload.release_cache (only with --offload on).")
    ] = "when_needed",
    optimizer_copy: Annotated[
        str, typer.Option(help="overlapped|with_weights: offload.optimizer_copy (only with --offload on).")
    ] = "overlapped",
    packed_attention: Annotated[
        str,
        typer.Option(
            help="auto, per_sample, efficient_varlen (CUDA), chunked_varlen, flash_varlen or cudnn_per_sample "
            "(CUDA, bf16): model.packed_attention."
        ),
    ] = "auto",
    profile_step: Annotated[
        int | None, typer.Option(help="Profile this step; its train phase's top ops go into the JSON.")
    ] = None,
    ranks: Annotated[
        int, typer.Option(help="torchrun ranks (DP, an engine each); --prompts counts over all of them.")
    ] = 1,
    lora_rank: Annotated[
        int | None, typer.Option(help="Train LoRA adapters of this rank (model.lora, alpha 2 x rank); unset: full.")
    ] = None,
    recompute: Annotated[str, typer.Option(help="train.recompute: none, selective or full.")] = "none",
    optimizer_offload: Annotated[
        str, typer.Option(help="on|off: optimizer.cpu_offload (Adam state on the host; CUDA only).")
    ] = "off",
    lm_head: Annotated[str, typer.Option(help="model.lm_head: chunked, chunked_kept or logits.")] = "chunked",
    engine_ranks: Annotated[
        int, typer.Option(help="placement.engine_ranks: ranks beyond --ranks that only generate (--offload off).")
    ] = 0,
    max_staleness: Annotated[int, typer.Option(help="rollout.max_staleness: steps generated ahead of training.")] = 0,
    out: OutFile = None,
) -> None:
    """Seconds per GRPO step of ``rlrun train`` (colocated, offload on by default), split by phase, tokens/s, memory."""
    from rlrun.config.schema import PackedAttention
    from rlrun.tools.bench.step import StepSettings, Variant, bench_step

    settings = StepSettings(
        shape=shape,
        backend=backend,
        prompts=prompts,
        samples=samples,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        steps=steps,
        micro_batch_samples=micro_batch_samples,
        lr=lr,
        seed=seed,
        updates_per_rollout=updates_per_rollout,
    )
    if packed_attention not in get_args(PackedAttention):
        raise typer.BadParameter(
            f"--packed-attention ({packed_attention}) must be one of "
            f"{list(get_args(PackedAttention))} because those are model.packed_attention's values"
        )
    variant = Variant(
        offload=_on_off("--offload", offload),
        teardown_nccl=_on_off("--teardown-nccl", teardown_nccl),
        release_cache=_choice("--release-cache", release_cache, "release_cache"),
        optimizer_copy=_choice("--optimizer-copy", optimizer_copy, "optimizer_copy"),
        packed_attention=packed_attention,
        lora_rank=lora_rank,
        recompute=_memory_options(recompute, None, "chunked", False).recompute,
        optimizer_offload=_on_off("--optimizer-offload", optimizer_offload),
        lm_head=_memory_options("none", None, lm_head, False).lm_head,
        engine_ranks=engine_ranks,
        max_staleness=max_staleness,
    )
    try:
        result = bench_step(settings, work, timeout_s, variant, profile_step, ranks)
    except ValueError as exc:  # settings that cannot run (prompts not divisible by ranks, profile step out of range)
        raise typer.BadParameter(str(exc)) from None
    _emit("step", [result], out)


def _choice(flag: str, value: str, field: str) -> Any:
    """``value`` if it is one of ``offload.<field>``'s values, else the CLI's error naming them."""
    from rlrun.config.schema import OffloadConfig

    choices = get_args(OffloadConfig.model_fields[field].annotation)
    if value not in choices:
        raise typer.BadParameter(
            f"{flag} ({value}) must be one of {list(choices)} because those are offload.{field}'s values"
        )
    return value


def _on_off(flag: str, value: str) -> bool:
    """``on``/``off`` as a bool: the flags read as the benchmark's variants do (offload on/off), not as typer's
    ``--x/--no-x`` pairs, so peer_step.py passes one value per flag."""
    if value not in ("on", "off"):
        raise typer.BadParameter(f"{flag} ({value}) must be on or off because it switches one mechanism; set {flag} on")
    return value == "on"
