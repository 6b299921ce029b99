"""The model families a config names, refused before any process starts as ``train`` refuses them.

``train`` builds the Megatron model from ``config.json`` (rlrun/megatron/hf_config.py) and refuses a family
it does not convert; this reads the same ``config.json`` and asks the same table
(rlrun/megatron/families.py), without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlrun.config.schema import RunConfig
from rlrun.megatron.families import family_feature

Problem = tuple[str, str]


def family_problems(cfg: RunConfig) -> list[Problem]:
    """One problem per model directory the trainer builds whose ``model_type`` it refuses. A directory
    without ``config.json`` is the input check's problem (rlrun/preflight/inputs.py), not this one's."""
    algo = cfg.algorithm
    dirs = [("model.path", cfg.model.path)]
    if algo.ref.path is not None:
        dirs.append(("algorithm.ref.path", algo.ref.path))  # an rlrun checkpoint directory has no config.json
    if algo.swaps_teacher and algo.opd.teacher_path is not None:
        dirs.append(("algorithm.opd.teacher_path", algo.opd.teacher_path))
    problems = []
    for key, value in dirs:
        config = Path(value) / "config.json"
        if not config.is_file():
            continue
        try:
            data = json.loads(config.read_text())
        except json.JSONDecodeError as err:
            problems.append((key, f"{key} ({value}): {config} must be JSON because it describes the model: {err}"))
            continue
        refused = family_feature(data if isinstance(data, dict) else {}, config).error
        if refused is not None:
            problems.append((key, f"{key} ({value}): {refused}"))
    return problems
