"""Run configs for tests: the keys every config must set (``REQUIRED_KEYS`` in rlrun/config/schema.py) filled
with the quickstart's values, under whatever sections a test gives.

A test states only what it is about (``run_config({"engine": {"tp": 2}})``); the model, prompts and reward it
does not care about are the quickstart's, and any of them the test sets wins.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rlrun.config.schema import DataConfig, ModelConfig, RolloutConfig, RunConfig

MODEL_PATH = ".cache/models/SmolLM2-135M-Instruct"
DATA_PATH = "configs/data/addition_train.jsonl"
REWARD = "first_number"
REQUIRED: dict[str, dict[str, Any]] = {
    "model": {"path": MODEL_PATH},
    "data": {"path": DATA_PATH},
    "rollout": {"reward": REWARD},
}
"""The required keys as config sections (configs/quickstart.yaml's values)."""


def minimal_config(sections: dict[str, Any] | None = None) -> dict[str, Any]:
    """``sections`` (a config as a nested dict) with the required keys it does not set filled in."""
    merged = copy.deepcopy(REQUIRED)
    for name, value in (sections or {}).items():
        if isinstance(value, dict) and name in merged:
            merged[name] = {**merged[name], **value}
        else:
            merged[name] = copy.deepcopy(value)
    return merged


def run_config(sections: dict[str, Any] | None = None) -> RunConfig:
    """``RunConfig.model_validate`` of :func:`minimal_config` (the same validation, the same errors)."""
    return RunConfig.model_validate(minimal_config(sections))


def rollout_config(**fields: Any) -> RolloutConfig:
    """A ``RolloutConfig`` scoring with the quickstart's reward unless ``fields`` set ``reward``."""
    return RolloutConfig(**{"reward": REWARD, **fields})


def data_config(**fields: Any) -> DataConfig:
    """A ``DataConfig`` reading the quickstart's prompts unless ``fields`` set ``path``."""
    return DataConfig(**{"path": DATA_PATH, **fields})


def model_config(**fields: Any) -> ModelConfig:
    """A ``ModelConfig`` of the quickstart's model unless ``fields`` set ``path``."""
    return ModelConfig(**{"path": MODEL_PATH, **fields})


def write_config(path: Path, text: str = "") -> Path:
    """Write a test's YAML ``text`` to ``path``, starting from a base file of the required keys.

    ``base:`` goes last, so the text's own keys keep their line numbers (errors name them) and win over the
    base's. Text that is not a mapping is written as is: the loader refuses it before any key is read.
    """
    body = "" if text.strip() == "{}" else text
    try:
        mapping = isinstance(yaml.safe_load(body), (dict, type(None)))
    except yaml.YAMLError:
        mapping = False
    if not mapping:
        path.write_text(text)
        return path
    base = path.with_name(f"{path.stem}_required.yaml")
    base.write_text(yaml.safe_dump(REQUIRED, sort_keys=False))
    if body and not body.endswith("\n"):
        body += "\n"
    path.write_text(f"{body}base: {base.name}\n")
    return path


def tiny_task_settings(model_dir: Path, run_dir: Path) -> list[str]:
    """``--set`` values that run the quickstart config on a tiny random model with a reward it can learn
    (``digit_fraction``), for the multi-process runs of tests and scripts."""
    rewards = Path(__file__).resolve().parent / "fixtures" / "rewards.py"
    return [
        f"model.path={model_dir}",
        f"logging.run_dir={run_dir}",
        f"rollout.reward={rewards}:digit_fraction",
        "rollout.max_new_tokens=6",
        "optimizer.lr=3e-3",
    ]
