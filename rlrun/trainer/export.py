"""What a run leaves behind when it ends: the policy as a Hugging Face directory (``checkpoint.export_at_end``).

    RUN_DIR/model/             config and tokenizer files of ``model.path`` (config.json's dtype set to the
                               trainer's), the trained weights as safetensors in the trainer's dtype (LoRA merged)
        adapter/               with ``model.lora``: the adapters alone, in PEFT's format

``AutoModelForCausalLM.from_pretrained(RUN_DIR/model)`` loads it, and its log-probs are the trainer's: the weights
are the trainer's own, gathered by the weight sync's export (rlrun/megatron/export.py), not cast. The directory is
written as ``RUN_DIR/.tmp-model`` and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlrun.config.schema import RunConfig
from rlrun.runtime.dist import Parallel
from rlrun.trainer.checkpoint import ADAPTER, copy_hf_files, step_dir_name

if TYPE_CHECKING:
    from rlrun.megatron.model import MegatronModel

MODEL_DIR = "model"
SHARD_BYTES = 5 * 2**30
"""Largest safetensors file written; bigger models get an index and several files."""


def announce_outputs(cfg: RunConfig, parallel: Parallel) -> None:
    """Rank 0 says, before the first step, what the run will leave and where (or that it leaves nothing)."""
    if not parallel.is_rank0:
        return
    ckpt = cfg.checkpoint
    ckpt_dir = Path(ckpt.dir) if ckpt.dir is not None else Path(cfg.logging.run_dir) / "checkpoints"
    kept = []
    if ckpt.save_at_end or ckpt.save_interval:
        every = f"every {ckpt.save_interval} steps and " if ckpt.save_interval else ""
        kept.append(f"a checkpoint {every}after the last step in {ckpt_dir}/{step_dir_name(cfg.train.num_steps)}")
    if ckpt.export_at_end:
        adapter = f" (LoRA adapters in {MODEL_DIR}/{ADAPTER})" if cfg.model.lora is not None else ""
        kept.append(f"the policy as a Hugging Face directory in {Path(cfg.logging.run_dir) / MODEL_DIR}{adapter}")
    what = "; ".join(kept) if kept else "no checkpoint or model (checkpoint.save_at_end and export_at_end are off)"
    print(f"[rlrun] this run saves {what}; a stop signal checkpoints too", flush=True)


def export_at_end(model: MegatronModel, cfg: RunConfig, step: int) -> Path | None:
    """Collective, when the run ends: ``export_policy`` unless ``checkpoint.export_at_end`` is off."""
    return export_policy(model, cfg, step) if cfg.checkpoint.export_at_end else None


def export_policy(model: MegatronModel, cfg: RunConfig, step: int) -> Path:
    """Collective: write the policy as ``RUN_DIR/model`` (see the module docstring); rank 0 writes the files."""
    from rlrun.megatron import export_hf_weights

    parallel = model.parallel
    run_dir = Path(cfg.logging.run_dir)
    tmp, final = run_dir / f".tmp-{MODEL_DIR}", run_dir / MODEL_DIR
    if parallel.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        copy_hf_files(Path(cfg.model.path), tmp)
    dist.barrier(group=parallel.cpu_group)
    # Every rank takes part in each tensor's gathers; rank 0 keeps a host copy of each.
    tensors = {name: tensor.cpu() for name, tensor in export_hf_weights(model) if parallel.is_rank0}
    if model.lora is not None:
        from rlrun.megatron.peft_export import write_peft_adapter

        write_peft_adapter(model, tmp / ADAPTER, cfg.model.path)
    if parallel.is_rank0:
        save_safetensors(tensors, tmp, getattr(torch, model.dtype))
        _set_config_dtype(tmp / "config.json", model.dtype)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        print(f"[rlrun] policy after step {step} exported: {final}", flush=True)
    dist.barrier(group=parallel.cpu_group)
    return final


def save_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, dtype: torch.dtype) -> None:
    """Write ``tensors`` (cast to ``dtype``) as ``model.safetensors``, or as numbered files with an index
    when they exceed ``SHARD_BYTES``, the way ``save_pretrained`` names them."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        tensor = tensor.to(dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))


def _set_config_dtype(config_file: Path, dtype: str) -> None:
    """The exported weights are in the trainer's dtype; config.json says so (``from_pretrained``'s default)."""
    config = json.loads(config_file.read_text())
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    config_file.write_text(json.dumps(config, indent=2) + "\n")
