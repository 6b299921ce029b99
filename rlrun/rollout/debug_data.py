"""Rollout and training data on disk, for offline inspection and for training without generating.

``debug.save_rollout_data`` writes each step's trained samples to ``RUN_DIR/debug/rollout_{step:06d}.jsonl``
(one JSON object per sample: prompt ids and text, label, response ids and text, rollout log-probs,
loss mask, reward, reward error). ``debug.load_rollout_data: DIR`` makes step ``k`` train on
``DIR/rollout_{k:06d}.jsonl`` instead of generating (SGLang/engine bugs vs trainer bugs). Training
data (``debug.save_train_data``) is each rank's micro-batches after log-probs and advantages, as
``RUN_DIR/debug/train_{step:06d}_rank{rank}.pt`` (a list of dicts of tensors; ``torch.load`` it).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rlrun.data.sample import Sample


def rollout_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"rollout_{step:06d}.jsonl"


def save_rollout(directory: str | Path, step: int, samples: list[Sample]) -> Path:
    path = rollout_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for sample in samples:
            out.write(json.dumps(dataclasses.asdict(sample), default=_jsonable) + "\n")
    return path


def _jsonable(value):
    """Tensors (``Sample.TENSOR_FIELDS``) as nested lists, so they load back; anything else as its ``str``."""
    import torch

    return value.tolist() if isinstance(value, torch.Tensor) else str(value)


def load_rollout(directory: str | Path, step: int) -> list[Sample]:
    """The samples saved for ``step``; a missing file names the directory and the step."""
    path = rollout_path(directory, step)
    if not path.is_file():
        raise FileNotFoundError(
            f"debug.load_rollout_data ({directory}) has no {path.name} for step {step}; "
            "train for at most as many steps as were saved, or save more with debug.save_rollout_data"
        )
    samples = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            samples.append(Sample.from_dict(row))
    return samples


def maybe_save_train_data(cfg, step: int, rank: int, micro_batches: list) -> None:
    """``save_train_data`` into ``RUN_DIR/debug`` when ``debug.save_train_data`` is on."""
    if cfg.debug.save_train_data:
        save_train_data(Path(cfg.logging.run_dir) / "debug", step, rank, micro_batches)


def save_train_data(directory: str | Path, step: int, rank: int, micro_batches: list) -> Path:
    """Every tensor field of this rank's micro-batches (tokens, masks, log-probs, advantages, ...)."""
    import torch

    path = Path(directory) / f"train_{step:06d}_rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb) if getattr(mb, f.name) is not None}
        for mb in micro_batches
    ]
    torch.save(rows, path)
    return path
