"""The critic's config file (``critic.config``): which models a PPO run trains, and how the critic differs.

As slime's ``--critic-config-path``: a YAML list of models, each with a ``role`` and
``overrides`` applied to a copy of the actor's settings::

    models:
      - role: actor                 # the run config itself; takes no overrides
      - role: critic
        overrides:                  # dotted keys, or nested sections
          model.path: .cache/models/SmolLM2-135M-Instruct   # trunk init (value head: score.* or fresh)
          optimizer.lr: 1.0e-4

The critic lives on the actor's ranks and hands its values over in-process, so it may override only
``model.*`` and ``optimizer.*``; ``parallel.*`` must equal the actor's (separate layouts would need the
values re-sharded between layouts: not supported yet). Read when the run config is validated, so a bad
file fails before any model loads. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from rlrun.config.load import read_yaml
from rlrun.config.schema import ModelConfig, OptimizerConfig, ParallelConfig

if TYPE_CHECKING:
    from rlrun.config.schema import RunConfig

ROLES = ("actor", "critic")
CRITIC_SECTIONS = ("model", "optimizer", "parallel")


@dataclass(frozen=True)
class CriticModelConfig:
    """The critic's settings: the actor's with the file's overrides applied."""

    model: ModelConfig
    optimizer: OptimizerConfig
    parallel: ParallelConfig


def load_critic_config(cfg: RunConfig) -> CriticModelConfig:
    """Read ``cfg.critic.config`` and apply its critic overrides to a copy of the actor's sections."""
    path = cfg.critic.config
    if path is None:
        raise ValueError(
            "critic.config (None) must name a critic YAML file because the run trains a critic; "
            "set critic.config: configs/critic/smollm2.yaml"
        )
    overrides = _critic_overrides(Path(path))
    sections: dict[str, BaseModel] = {}
    for name in CRITIC_SECTIONS:
        base: BaseModel = getattr(cfg, name)
        update = {key.partition(".")[2]: value for key, value in overrides.items() if key.partition(".")[0] == name}
        if name == "model":
            update["lora"] = None  # the actor's LoRA is the actor's: the critic trains its whole trunk
        try:
            sections[name] = type(base).model_validate({**base.model_dump(), **update})
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(
                f"critic.config ('{path}'): critic override {name}.{first['loc'][0]} "
                f"({first['input']!r}) is invalid: {first['msg']}; fix it in {path}"
            ) from None
    if sections["parallel"] != cfg.parallel:
        raise ValueError(
            f"critic.config ('{path}'): the critic's parallel layout ({sections['parallel']}) must equal "
            f"the actor's ({cfg.parallel}) because the critic shares the actor's ranks and hands its "
            f"values over in-process (different layouts are not supported yet); remove the parallel "
            f"overrides from {path}"
        )
    return CriticModelConfig(**sections)


def _critic_overrides(path: Path) -> dict[str, Any]:
    """The dotted overrides of the file's single critic entry."""
    if not path.is_file():
        raise ValueError(
            f"critic.config ('{path}') must be an existing YAML file because it lists the models "
            f"of the PPO run (cwd {Path.cwd()}); set critic.config: configs/critic/smollm2.yaml"
        )
    data = read_yaml(path) or {}  # a syntax error is a ConfigError naming the file's line
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise ValueError(
            f"critic.config ('{path}') must hold 'models:', a list of {{role, overrides}} entries, "
            f"because each entry describes one model; see configs/critic/smollm2.yaml"
        )
    roles = [m.get("role") for m in models]
    if any(role not in ROLES for role in roles) or roles.count("critic") != 1 or roles.count("actor") > 1:
        raise ValueError(
            f"critic.config ('{path}') roles ({roles}) must be one 'critic' and at most one 'actor' "
            f"because one critic is supported so far; fix the models list"
        )
    for entry in models:
        unknown = set(entry) - {"role", "overrides"}
        if unknown:
            raise ValueError(
                f"critic.config ('{path}') entry keys ({sorted(unknown)}) must be role or overrides; "
                f"move settings under overrides"
            )
        if entry["role"] == "actor" and entry.get("overrides"):
            raise ValueError(
                f"critic.config ('{path}') actor overrides ({entry['overrides']}) must be empty because "
                f"the actor is the run config itself; set them in the run config"
            )
    critic = models[roles.index("critic")]
    overrides = _flatten(critic.get("overrides") or {})
    outside = sorted(key for key in overrides if key.partition(".")[0] not in CRITIC_SECTIONS or "." not in key)
    if outside:
        raise ValueError(
            f"critic.config ('{path}') critic overrides ({outside}) must be under "
            f"{', '.join(CRITIC_SECTIONS)} because the critic shares the actor's loop, data and "
            f"checkpoints; remove them"
        )
    lora = sorted(key for key in overrides if key.startswith("model.lora"))
    if lora:
        raise ValueError(
            f"critic.config ('{path}') critic overrides ({lora}) must not set model.lora because the critic "
            f"trains its whole trunk and value head (LoRA is the actor's, rlrun/megatron/lora.py); remove them"
        )
    return overrides


def _flatten(node: dict, prefix: str = "") -> dict[str, Any]:
    """``{optimizer: {lr: 1}}`` and ``{optimizer.lr: 1}`` both become ``{"optimizer.lr": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
