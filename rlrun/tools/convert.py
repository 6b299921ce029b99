"""``rlrun convert``: HF directories <-> Megatron distributed checkpoints, in the format training uses.

    rlrun convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N]
    rlrun convert mcore-to-hf --ckpt DIR --out DIR [--hf DIR]

``hf-to-mcore`` builds the model with ``build_model`` (the weight map of rlrun/megatron/hf_weights.py) on
``tp * pp`` ranks and saves its weights as a checkpoint directory shaped like a training checkpoint
(``actor/``, ``hf/`` with the config and tokenizer files, a ``COMPLETE`` marker saying weights only),
so ``checkpoint.load=DIR`` starts training from it at step 0. ``mcore-to-hf`` takes that output or any
training checkpoint (``step_*``), builds the model on the layout that saved it, loads the checkpoint and
writes what ``export_hf_weights`` yields (padding cut off, the HF names) as safetensors in the dtype of
the original ``config.json``, next to the saved config and tokenizer files. A LoRA run's checkpoint (one with
``adapter/``) is built with its adapters and written merged, ``W + alpha/r * B A`` (rlrun/megatron/lora.py).

Ranks: when started by torchrun with ``tp * pp`` processes the command runs on them; otherwise it starts
the ranks itself (local processes, gloo on CPU, NCCL on GPUs). ``build_model`` loads HF weights before
the checkpoint overwrites them, so ``mcore-to-hf`` needs the HF directory the checkpoint was built from
(recorded in the marker, or ``--hf``); only its architecture and shapes matter.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlrun.trainer.checkpoint import ACTOR, ADAPTER, COMPLETE, HF_FILES, Layout, Marker, copy_hf_files
from rlrun.trainer.export import save_safetensors

log = logging.getLogger(__name__)


class ConvertError(ValueError):
    """A conversion that cannot run as asked; the message names the argument and the fix."""


@dataclass(frozen=True)
class HfToMcore:
    hf_dir: Path
    out_dir: Path
    tp: int
    pp: int
    dtype: str

    def run(self, parallel) -> None:
        """On every rank: build the model from ``hf_dir``, save its weights; rank 0 writes the rest."""
        from rlrun.megatron import build_model
        from rlrun.megatron.checkpoint import start_save, training_state

        model = build_model(str(self.hf_dir), parallel, dtype=self.dtype)
        pending = start_save(training_state(model, None, None, with_rng=False), self.out_dir / ACTOR)
        pending.write()
        pending.finish()
        if parallel.is_rank0:
            copy_hf_files(self.hf_dir, self.out_dir / HF_FILES)
            marker = Marker(step=0, layout=Layout.of(parallel), weights_only=True, model_path=str(self.hf_dir))
            marker.write(self.out_dir)


@dataclass(frozen=True)
class McoreToHf:
    ckpt_dir: Path
    out_dir: Path
    hf_dir: Path
    dtype: str

    def run(self, parallel) -> None:
        """On every rank: build the model, load the checkpoint, export; rank 0 writes the safetensors."""
        from rlrun.megatron import build_model, export_hf_weights
        from rlrun.megatron.checkpoint import load_weights
        from rlrun.megatron.peft_export import read_lora_config

        lora = read_lora_config(self.ckpt_dir / ADAPTER)
        model = build_model(str(self.hf_dir), parallel, dtype=self.dtype, lora=lora)
        load_weights(model, self.ckpt_dir / ACTOR)
        tensors = {name: tensor.cpu() for name, tensor in export_hf_weights(model)}
        if parallel.is_rank0:
            save_safetensors(tensors, self.out_dir, _hf_dtype(self.ckpt_dir / HF_FILES, model.dtype))
            copy_hf_files(self.ckpt_dir / HF_FILES, self.out_dir)


def hf_to_mcore(hf_dir: Path, out_dir: Path, tp: int = 1, pp: int = 1, dtype: str = "float32") -> None:
    """Convert HF directory ``hf_dir`` into the checkpoint directory ``out_dir`` (must not hold one yet)."""
    if not (hf_dir / "config.json").is_file():
        raise ConvertError(
            f"--hf ({hf_dir}) must be a Hugging Face model directory with config.json because its "
            f"architecture and weights are converted; point --hf at one"
        )
    if (out_dir / COMPLETE).exists() or (out_dir / ACTOR).exists():
        raise ConvertError(
            f"--out ({out_dir}) must not hold a checkpoint already because converting would mix "
            f"two; remove it or pick another --out"
        )
    (out_dir / ACTOR).mkdir(parents=True)
    _on_ranks(HfToMcore(hf_dir.resolve(), out_dir, tp, pp, dtype).run, tp, pp)


def mcore_to_hf(ckpt_dir: Path, out_dir: Path, hf_dir: Path | None = None) -> None:
    """Write the model of checkpoint ``ckpt_dir`` (convert output or a ``step_*`` directory) as an HF directory."""
    if not (ckpt_dir / COMPLETE).is_file():
        raise ConvertError(
            f"--ckpt ({ckpt_dir}) must be a complete checkpoint (with a {COMPLETE} marker): the "
            f"output of `rlrun convert hf-to-mcore` or a checkpoint.dir's step_* directory"
        )
    marker = Marker.read(ckpt_dir)
    source = hf_dir if hf_dir is not None else Path(marker.model_path) if marker.model_path else None
    if source is None or not (source / "config.json").is_file():
        raise ConvertError(
            f"--hf ({source}) must be the HF directory checkpoint {ckpt_dir} was built from because "
            f"the model is built from it before the checkpoint's weights replace its own; pass --hf"
        )
    if not (ckpt_dir / HF_FILES / "config.json").is_file():
        raise ConvertError(
            f"--ckpt ({ckpt_dir}) must hold {HF_FILES}/config.json because the HF output copies its "
            f"config and tokenizer files from there; the checkpoint was saved without them"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built in fp32: a bf16 checkpoint loads into it exactly, and the export is cast to config.json's dtype.
    _on_ranks(McoreToHf(ckpt_dir, out_dir, source.resolve(), "float32").run, marker.layout.tp, marker.layout.pp)


def _hf_dtype(hf_files: Path, fallback: str) -> torch.dtype:
    """The dtype ``config.json`` declares (``dtype``, or ``torch_dtype`` before transformers 5)."""
    config = json.loads((hf_files / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or fallback
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ConvertError(
            f"{hf_files / 'config.json'} dtype ({name}) must name a torch dtype because the weights "
            f"are written in it; fix config.json"
        )
    return dtype


def _on_ranks(fn: Callable, tp: int, pp: int) -> None:
    """Run ``fn(parallel)`` on ``tp * pp`` ranks: these, when torchrun started that many, else new local ones."""
    world = tp * pp
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == world:
        _rank_main(fn, tp, pp)
        return
    if "RANK" in os.environ:
        raise ConvertError(
            f"the number of processes ({os.environ.get('WORLD_SIZE')}) must be --tp * --pp ({world}) "
            f"because each rank holds one shard; launch that many, or run without torchrun"
        )
    for attempt in range(1, PORT_ATTEMPTS + 1):
        failed, detail = _spawn_ranks(fn, tp, pp)
        if not failed:
            return
        if "EADDRINUSE" not in detail or attempt == PORT_ATTEMPTS:
            raise RuntimeError(f"conversion failed on ranks {failed} (rank, exit code):\n{detail}")
        log.warning("conversion ranks' port was taken before they bound it (attempt %d); retrying on another", attempt)


PORT_ATTEMPTS = 3
"""Tries of the spawned ranks' rendezvous: the free port is picked before rank 0 binds it, so another process can take
it in between; rank 0 then fails with EADDRINUSE and the conversion starts again on a new port."""


def _spawn_ranks(fn: Callable, tp: int, pp: int) -> tuple[list[tuple[int, int | None]], str]:
    """Run ``fn`` on ``tp * pp`` new local ranks; returns the failed ranks (rank, exit code) and the first traceback.
    A rank that fails stops the others at once: they would wait for it in their first collective forever."""
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    from rlrun.runtime.dist import free_port

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    world, port = tp * pp, free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(fn, tp, pp, rank, world, port, errors)) for rank in range(world)]
    for proc in procs:
        proc.start()
    running = list(procs)
    while running:
        wait([proc.sentinel for proc in running])
        running = [proc for proc in running if proc.exitcode is None]
        if any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in running:
                proc.terminate()
    for proc in procs:
        proc.join()
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode != 0]
    if not failed:
        return [], ""
    try:
        return failed, errors.get(timeout=5)
    except queue.Empty:
        return failed, "no traceback (killed?)"


def _spawned_rank(fn: Callable, tp: int, pp: int, rank: int, world: int, port: int, errors) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        _rank_main(fn, tp, pp)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def _rank_main(fn: Callable, tp: int, pp: int) -> None:
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(tp, pp, seed=0)
    try:
        fn(parallel)
    finally:
        destroy_distributed()
