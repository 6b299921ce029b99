"""The ``rlrun convert`` commands (rlrun/tools/convert.py does the work; torch is imported only when one runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

convert_app = typer.Typer(no_args_is_help=True, help="Convert between HF directories and Megatron checkpoints.")


@convert_app.command("hf-to-mcore")
def hf_to_mcore(
    hf: Annotated[Path, typer.Option(help="Hugging Face model directory (config.json + safetensors).")],
    out: Annotated[Path, typer.Option(help="Checkpoint directory to write (checkpoint.load takes it).")],
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size the checkpoint is sharded for.")] = 1,
    pp: Annotated[int, typer.Option(min=1, help="Pipeline-parallel size.")] = 1,
    dtype: Annotated[str, typer.Option(help="Parameter dtype: float32 or bfloat16 (as model.dtype).")] = "float32",
) -> None:
    """Write an HF model as a Megatron distributed checkpoint (weights only) for training to start from."""
    from rlrun.tools.convert import ConvertError
    from rlrun.tools.convert import hf_to_mcore as convert

    try:
        convert(hf, out, tp=tp, pp=pp, dtype=dtype)
    except ConvertError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {out} (tp={tp}, pp={pp}); train from it with --set checkpoint.load={out}")


@convert_app.command("mcore-to-hf")
def mcore_to_hf(
    ckpt: Annotated[Path, typer.Option(help="hf-to-mcore output or a checkpoint's step_* directory.")],
    out: Annotated[Path, typer.Option(help="HF directory to write (safetensors + config/tokenizer).")],
    hf: Annotated[
        Path | None,
        typer.Option(help="HF directory the checkpoint was built from, when its recorded model path has moved."),
    ] = None,
) -> None:
    """Write a Megatron checkpoint's model as an HF directory."""
    from rlrun.tools.convert import ConvertError
    from rlrun.tools.convert import mcore_to_hf as convert

    try:
        convert(ckpt, out, hf_dir=hf)
    except ConvertError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {out}")
