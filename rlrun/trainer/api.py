"""``rlrun.train``: the Python entry point, what ``rlrun train`` does for a config given in code.

    import rlrun
    rlrun.train("configs/quickstart.yaml", train={"num_steps": 2})            # one process
    rlrun.train({"model": {"path": ...}, "data": {"path": ...}, "rollout": {"reward": "math"}})

Under ``torchrun`` every rank calls it with the same arguments; without torchrun it is one process (world size
1, a free local port for the process groups: rlrun/runtime/dist.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from rlrun.config.load import LoadedConfig, read_config, read_config_dict
from rlrun.config.schema import RunConfig


def train(config: str | Path | dict[str, Any] | RunConfig, **overrides: Any) -> Path:
    """Train as ``config`` says (a YAML path, a nested dict of sections, or a ``RunConfig``) and return the run
    directory (``logging.run_dir``: metrics.jsonl, checkpoints, the exported ``model/``).

    ``overrides`` are sections as dicts (``train={"num_steps": 2}``) or dotted keys (``**{"train.num_steps": 2}``),
    applied after the file. A config mistake raises ``ConfigError`` (one line per problem, naming the key); the
    files the config names are checked before anything starts. With a dict, an unset ``logging.run_dir`` is
    ``runs/run``. When the trainer's memory region exists (``offload.train`` on a GPU) the process ends with the
    run, as ``rlrun train`` does: torch_memory_saver cannot be torn down by Python.
    """
    from rlrun.preflight import preflight

    cfg = preflight(_read(config, overrides))  # everything the config names, before any process starts
    from rlrun.megatron.attention import core_attention

    core_attention(cfg.model.packed_attention, cfg.model.dtype)  # raises when the machine lacks what it needs
    run_to_end(cfg)
    return Path(cfg.logging.run_dir)


def run_to_end(cfg: RunConfig) -> None:
    """The loop (``rlrun train`` and :func:`train`); the process ends with the run where torch_memory_saver would
    abort Python's teardown of the trainer (``Offloader.needs_hard_exit``)."""
    from rlrun.trainer.loop import run

    if run(cfg):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _read(config: str | Path | dict[str, Any] | RunConfig, overrides: dict[str, Any]) -> LoadedConfig:
    if isinstance(config, RunConfig):
        return read_config_dict(config.model_dump(mode="json"), values=overrides)
    if isinstance(config, dict):
        return read_config_dict(config, values=overrides)
    return read_config(config, values=overrides)
