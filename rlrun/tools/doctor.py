"""``rlrun doctor [CONFIG]``: what this machine has, and what the config would need that it lacks.

Three groups of checks, each a :class:`Check` with a status:

* packages: versions of torch (with its CUDA and NCCL), megatron-core, transformers, sglang,
  torch_memory_saver, pyzmq and the optional logging/plot packages;
* devices: the GPUs torch can see (or why a run would use CPU and gloo);
* config: for each thing the config turns on, whether its requirement is met (model directory, the
  model's family and each architectural feature it needs, supported or refused, prompt file, engine
  backend, offload, TensorBoard/W&B packages, training ranks (the world less ``placement.engine_ranks``) vs
  ``parallel.tp``, the checkpoint it would resume from), the trainer's estimated memory per rank against the
  GPU and the host (rlrun/tools/memory_estimate.py), and each phase of a step (rollout, logprobs, train, sync)
  with trainer and engine together on one GPU (rlrun/tools/phase_memory.py): a phase over the device is
  ``missing``, with the fields to change.

``missing`` means the run would fail; ``warn`` means it would run, but probably not as meant.
"""

from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from rlrun.config.schema import RunConfig
from rlrun.engine.registry import backend_traits

Status = Literal["ok", "info", "warn", "missing"]
REQUIRED = ("torch", "megatron-core", "transformers", "pyzmq", "msgpack", "pydantic", "typer", "safetensors", "rich")
OPTIONAL = ("sglang", "torch-memory-saver", "tensorboard", "wandb", "matplotlib")


@dataclass(frozen=True)
class Check:
    group: str
    name: str
    status: Status
    detail: str


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def package_checks() -> list[Check]:
    checks = [Check("packages", "python", "ok", platform.python_version())]
    for dist in (*REQUIRED, *OPTIONAL):
        version = _version(dist)
        if version is not None:
            checks.append(Check("packages", dist, "ok", version))
        else:
            checks.append(Check("packages", dist, "missing" if dist in REQUIRED else "info", "not installed"))
    return checks


def device_checks() -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        return [
            Check(
                "devices",
                "cuda",
                "info",
                f"no CUDA device visible (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda or 'none'}): runs use CPU processes, gloo and the embedded engine",
            )
        ]
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    checks = [
        Check("devices", "cuda", "ok", f"CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} GPU(s)")
    ]
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        checks.append(Check("devices", f"cuda:{index}", "ok", f"{props.name}, {props.total_memory / 2**30:.0f} GiB"))
    return checks


def config_checks(cfg: RunConfig, num_gpus: int, device_gib: float | None = None) -> list[Check]:
    """What ``cfg`` turns on, and whether this machine provides it (``num_gpus`` visible, the first one of
    ``device_gib``)."""
    from rlrun.trainer.checkpoint import resolve_resume

    checks = [
        _model_check(cfg),
        *_architecture_checks(cfg),
        *_memory_checks(cfg, num_gpus, device_gib),
        _data_check(cfg),
    ]
    traits = backend_traits(cfg.engine.backend)
    needs = [f"the {traits.package} package"] if traits.package else []
    needs += ["a GPU"] if traits.needs_gpu else []
    if needs:
        missing = (traits.package is not None and _version(traits.package) is None) or (
            traits.needs_gpu and num_gpus == 0
        )
        checks.append(
            Check(
                "config",
                "engine.backend",
                "missing" if missing else "ok",
                f"{cfg.engine.backend} needs {' and '.join(needs)}"
                + ("; set engine.backend=embedded" if missing else ": present"),
            )
        )
    if (cfg.offload.train or cfg.offload.rollout) and num_gpus > 0 and _version("torch-memory-saver") is None:
        checks.append(
            Check("config", "offload", "missing", "offload needs torch_memory_saver; pip install torch-memory-saver")
        )
    if cfg.model.dtype == "bfloat16" and num_gpus == 0:
        checks.append(
            Check("config", "model.dtype", "warn", "bfloat16 on CPU is slow and loses precision; use float32")
        )
    for enabled, name, module in (
        (cfg.logging.tensorboard, "logging.tensorboard", "tensorboard"),
        (bool(cfg.logging.wandb_project), "logging.wandb_project", "wandb"),
    ):
        if enabled:
            found = importlib.util.find_spec(module) is not None
            checks.append(
                Check(
                    "config",
                    name,
                    "ok" if found else "missing",
                    f"{module} installed" if found else f"needs {module}; pip install {module}",
                )
            )
    checks.append(_world_size_check(cfg, num_gpus))
    ckpt_dir = Path(cfg.checkpoint.dir or Path(cfg.logging.run_dir) / "checkpoints")
    try:
        resume = resolve_resume(cfg.checkpoint.resume, ckpt_dir)
        checks.append(
            Check(
                "config",
                "checkpoint.resume",
                "info",
                f"would resume from {resume}" if resume else f"fresh start (no complete checkpoint in {ckpt_dir})",
            )
        )
    except ValueError as exc:
        checks.append(Check("config", "checkpoint.resume", "missing", str(exc)))
    return checks


def _model_check(cfg: RunConfig) -> Check:
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        return Check(
            "config",
            "model.path",
            "missing",
            f"{path} has no config.json; download the model there "
            "(huggingface-cli download ORG/NAME --local-dir DIR; for the quickstart: rlrun prepare smollm2) "
            "or set model.path",
        )
    weights = list(path.glob("*.safetensors"))
    if not weights:
        return Check("config", "model.path", "missing", f"{path} has no *.safetensors weights")
    size = sum(w.stat().st_size for w in weights) / 2**30
    return Check("config", "model.path", "ok", f"{path} ({len(weights)} safetensors file(s), {size:.2f} GiB)")


def _architecture_checks(cfg: RunConfig) -> list[Check]:
    """``model.family`` and one ``model: <feature>`` row per feature of config.json, ``missing`` when refused."""
    import json

    from rlrun.megatron.hf_config import family_feature, model_features

    path = Path(cfg.model.path) / "config.json"
    if not path.is_file():
        return []
    hf_config = json.loads(path.read_text())
    checks = []
    for feature in (family_feature(hf_config, path), *model_features(hf_config, path)):
        name = "model.family" if feature.name == "family" else f"model: {feature.name}"
        if feature.supported:
            checks.append(Check("config", name, "ok", f"{feature.detail} (supported)".lstrip()))
        else:
            checks.append(Check("config", name, "missing", f"refused: {feature.error}"))
    return checks


def _memory_checks(cfg: RunConfig, num_gpus: int, device_gib: float | None) -> list[Check]:
    """The trainer's estimated memory per rank (rlrun/tools/memory_estimate.py) against the first GPU and the host
    (``warn`` where it would not fit: the estimate is within a few GiB of the peaks it is calibrated against), then each
    phase of a step, trainer and engine together on one GPU (rlrun/tools/phase_memory.py; ``missing`` where a phase
    exceeds the device, with the fields that lower it)."""
    from rlrun.megatron.hf_config import ModelArch
    from rlrun.tools.memory_estimate import estimate

    path = Path(cfg.model.path) / "config.json"
    if not path.is_file():
        return []
    try:
        arch = ModelArch.from_hf_dir(cfg.model.path)
    except ValueError:
        return []  # the architecture checks name the refusal
    model_parallel = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    world = int(os.environ.get("WORLD_SIZE", num_gpus or model_parallel))
    dp = max((world - cfg.placement.engine_ranks) // model_parallel, 1)
    e = estimate(cfg, arch, dp)
    detail = (
        f"~{e.total_gib:.1f} GiB per rank at dp={dp}: weights {e.weights_gib:.1f}, grads {e.grads_gib:.1f}, "
        f"optimizer {e.optimizer_gib:.1f}, activations {e.activations_gib:.1f} "
        f"({e.activation_bytes_per_token / 2**20:.2f} MiB/token x train.max_tokens_per_micro_batch "
        f"{cfg.train.max_tokens_per_micro_batch}, train.recompute {cfg.train.recompute}), "
        f"LM head {e.lm_head_gib:.1f} (model.lm_head {cfg.model.lm_head})"
    )
    checks = []
    if device_gib is None:
        checks.append(Check("config", "memory: trainer", "info", detail))
    else:
        fits = e.total_gib <= device_gib
        fix = (
            ""
            if fits
            else "; set train.recompute: full, lower train.max_tokens_per_micro_batch, "
            "or set optimizer.use_distributed_optimizer / optimizer.cpu_offload"
        )
        checks.append(
            Check("config", "memory: trainer", "ok" if fits else "warn", f"{detail} of {device_gib:.0f} GiB{fix}")
        )
    if e.host_optimizer_gib > 0:
        host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        per_host = e.host_optimizer_gib * max(num_gpus, 1)
        fits = per_host <= 0.9 * host_gib
        checks.append(
            Check(
                "config",
                "memory: host optimizer",
                "ok" if fits else "warn",
                f"~{e.host_optimizer_gib:.1f} GiB pinned host memory per rank ({per_host:.1f} for this host's ranks) "
                f"of {host_gib:.0f} GiB"
                + ("" if fits else "; lower optimizer.offload_fraction or shard over more data-parallel ranks"),
            )
        )
    return checks + _phase_checks(cfg, arch, dp, world, device_gib)


def _phase_checks(cfg: RunConfig, arch, dp: int, world: int, device_gib: float | None) -> list[Check]:
    """One ``memory: <phase>`` row per placement of a step (rlrun/tools/phase_memory.py), ``missing`` when it plus the
    trainer region's margin (``offload.memory_margin_gb``, with offload.train) exceeds ``device_gib``."""
    from rlrun.tools.phase_memory import GB, phase_memory

    prompt_tokens = _longest_prompt(cfg)
    prompt_note = (
        f"longest prompt {prompt_tokens} tokens"
        if prompt_tokens is not None
        else "prompt length unknown (no tokenizer in model.path or data.path unreadable): counted as 0 tokens"
    )
    margin = cfg.offload.memory_margin_gb * GB / 2**30 if cfg.offload.train else 0.0
    checks = []
    for phase in phase_memory(cfg, arch, dp, world, device_gib, prompt_tokens or 0):
        parts = ", ".join(f"{name} {gib:.1f}" for name, gib in phase.parts.items())
        detail = f"~{phase.total_gib:.1f} GiB per GPU: {parts}"
        if phase.phase == "rollout":
            detail += f" ({prompt_note})"
        if device_gib is None:
            checks.append(Check("config", f"memory: {phase.phase}", "info", detail))
            continue
        fits = phase.total_gib + margin <= device_gib
        detail += f" of {device_gib:.0f} GiB" + (
            f" ({margin:.1f} kept free by offload.memory_margin_gb)" if margin else ""
        )
        if not fits:
            detail += f"; to fit: {'; '.join(phase.fixes)}"
        checks.append(Check("config", f"memory: {phase.phase}", "ok" if fits else "missing", detail))
    return checks


def _longest_prompt(cfg: RunConfig) -> int | None:
    """Tokens of the longest prompt of ``data.path`` as the run tokenizes it (None: no tokenizer or no data)."""
    from rlrun.data.prompt_files import PromptDataError
    from rlrun.data.prompts import PromptDataset

    if not (Path(cfg.model.path) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        dataset = PromptDataset(cfg.data, AutoTokenizer.from_pretrained(cfg.model.path))
    except (PromptDataError, OSError, ValueError):
        return None
    return max((len(p.prompt_ids) for p in dataset.prompts), default=0)


def _data_check(cfg: RunConfig) -> Check:
    from rlrun.data.prompt_files import PromptDataError, read_rows

    try:
        rows = read_rows(cfg.data.path, cfg.data.prompt_key, cfg.data.label_key)
    except PromptDataError as exc:
        return Check("config", "data.path", "missing", str(exc))
    return Check("config", "data.path", "ok", f"{cfg.data.path}: {len(rows)} prompts")


def _world_size_check(cfg: RunConfig, num_gpus: int) -> Check:
    """The training ranks (all but the last ``placement.engine_ranks``) against the model-parallel layout."""
    world_size = int(os.environ.get("WORLD_SIZE", num_gpus or 0))
    model_parallel = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    layout = "tp x pp" if cfg.parallel.cp == 1 else "tp x pp x cp"
    n = cfg.placement.engine_ranks
    engines = f" + {n} engine ranks ({n // cfg.engine.tp} engine(s) of engine.tp {cfg.engine.tp})" if n else ""
    if world_size == 0:
        return Check(
            "config",
            "parallel",
            "info",
            f"{layout} = {model_parallel}: launch a multiple of {model_parallel} "
            f"processes{engines} (torchrun --nproc-per-node N)",
        )
    training = world_size - n
    if training < 1 or training % model_parallel:
        return Check(
            "config",
            "parallel",
            "missing",
            f"{world_size} ranks (GPUs visible){' less ' + str(n) + ' engine ranks' if n else ''} is not a "
            f"multiple of {layout} = {model_parallel}; set parallel.tp or launch a multiple of {model_parallel} "
            "training ranks per job",
        )
    return Check(
        "config",
        "parallel",
        "ok",
        f"{training} ranks = {training // model_parallel} data-parallel replica(s) of {layout} = {model_parallel}"
        + engines,
    )


def run_doctor(cfg: RunConfig | None) -> list[Check]:
    import torch

    checks = package_checks() + device_checks()
    if cfg is not None:
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if num_gpus else None
        checks += config_checks(cfg, num_gpus, device_gib)
    return checks


def print_checks(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    colour = {"ok": "green", "info": "cyan", "warn": "yellow", "missing": "red"}
    table = Table(show_lines=False)
    for column in ("group", "check", "status", "detail"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.group, c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail)
    Console().print(table)
