"""The LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are PEFT's for a causal LM, ``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight``
(``[r, in]``) and ``...lora_B.weight`` (``[out, r]``), full (TP-gathered) tensors of every pipeline stage, so
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model.path), directory)`` loads them and
vLLM / SGLang serve them as a LoRA adapter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlrun.megatron.model import MegatronModel
from rlrun.megatron.tp_layout import Partition

if TYPE_CHECKING:
    from rlrun.config.schema import LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@torch.no_grad()
def full_adapter_tensors(model: MegatronModel) -> dict[str, torch.Tensor]:
    """Collective: every adapter tensor of the whole model on global rank 0 (PEFT keys, CPU); {} elsewhere."""
    from megatron.core import parallel_state as mpu

    assert model.lora is not None, "full_adapter_tensors needs a model built with model.lora"
    parallel = model.parallel
    mine: dict[str, torch.Tensor] = {}
    group = mpu.get_tensor_model_parallel_group()
    for key, param in model.lora.peft_tensors():
        mine[key] = Partition.of(param).gather(param.detach(), parallel.tp_size, group).cpu().contiguous()
    # One sender per pipeline stage (DP replicas and TP peers hold the same full tensors).
    sends = parallel.tp_rank == 0 and parallel.dp_rank == 0
    gathered: list[dict[str, torch.Tensor] | None] = [None] * parallel.world_size if parallel.is_rank0 else []
    dist.gather_object(mine if sends else {}, gathered if parallel.is_rank0 else None, dst=0, group=parallel.cpu_group)
    return {k: v for part in gathered if part for k, v in part.items()}


def write_peft_adapter(model: MegatronModel, directory: Path, base_model_path: str | None) -> None:
    """Collective: rank 0 writes the adapters of ``model`` into ``directory`` in PEFT's format."""
    from safetensors.torch import save_file

    tensors = full_adapter_tensors(model)
    if not model.parallel.is_rank0:
        return
    assert model.lora is not None
    cfg = model.lora.cfg
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_lora_config(directory: Path) -> LoraConfig | None:
    """The ``model.lora`` that wrote the PEFT adapter in ``directory``; None when it holds none."""
    from rlrun.config.schema import LoraConfig

    path = directory / CONFIG_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return LoraConfig(
        rank=raw["r"], alpha=raw["lora_alpha"], dropout=raw["lora_dropout"], target_modules=raw["target_modules"]
    )
