"""Load-time checks of the ``algorithm`` section that need rlrun/algo's tables, and its user hooks' signatures.

``algorithm_problems(cfg)`` returns every problem as ``(dotted key, message)``, the message in the house
style (``<key> (<value>) must ... because ...; set ...``); the caller adds the file and line of the key.
The section's checks of its own fields alone are the schema's (``AlgorithmConfig._compatible``).
Imports no torch: ``rlrun config validate`` stays instant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from rlrun.algo.entries import settings_of
from rlrun.algo.estimators import ESTIMATORS
from rlrun.algo.losses import POLICY_LOSSES
from rlrun.algo.specs import unknown_name
from rlrun.runtime.hooks import load_hook

if TYPE_CHECKING:
    from rlrun.config.schema import AlgorithmConfig, RunConfig

CUSTOM_ADVANTAGE_SIGNATURE = "fn(cfg: AlgorithmConfig, mb: MicroBatch, kl: Tensor) -> (advantages, returns)"
CUSTOM_LOSS_SIGNATURE = "fn(cfg: AlgorithmConfig, mb: MicroBatch, logprobs, entropy, aggregate) -> (loss, metrics)"
POSTPROCESS_SIGNATURE = "fn(cfg: AlgorithmConfig, step: int, micro_batches: list[MicroBatch]) -> None"
HOOKS = {
    "custom_advantage": (CUSTOM_ADVANTAGE_SIGNATURE, 3),
    "custom_loss": (CUSTOM_LOSS_SIGNATURE, 5),
    "rollout_data_postprocess": (POSTPROCESS_SIGNATURE, 3),
}

Problem = tuple[str, str]


def algorithm_problems(cfg: RunConfig) -> list[Problem]:
    """Every problem of ``cfg.algorithm`` that the schema cannot see: names of estimators and losses, their
    settings and what an estimator requires (whitening, a critic). The user hooks (``HOOKS``) are resolved by
    the preflight's hook table, which reads their signatures here."""
    algo = cfg.algorithm
    problems = _entry_problems(algo)
    estimator = ESTIMATORS.get(algo.estimator_name)
    if estimator is not None:
        problems += _requirement_problems(cfg, estimator)
    return problems


def load_algorithm_hook(cfg: AlgorithmConfig, field: str):
    """The function of hook ``field`` (None when unset); already validated at config load."""
    spec = getattr(cfg, field)
    if spec is None:
        return None
    signature, num_args = HOOKS[field]
    return load_hook(spec, f"algorithm.{field}", signature, num_args)


def _entry_problems(algo: AlgorithmConfig) -> list[Problem]:
    key = "algorithm.advantage_estimator"
    if algo.estimator_name not in ESTIMATORS:
        return [(key, unknown_name(ESTIMATORS, algo.estimator_name, key))]
    problems = _settings_problems(key, ESTIMATORS[algo.estimator_name], algo, algo.estimator_settings)
    key = "algorithm.policy_loss"
    loss = algo.policy_loss_name or ESTIMATORS[algo.estimator_name].policy_loss
    if loss not in POLICY_LOSSES:
        return problems + [(key, unknown_name(POLICY_LOSSES, loss, key))]
    return problems + _settings_problems(key, POLICY_LOSSES[loss], algo, algo.policy_loss_settings)


def _settings_problems(key: str, entry: Any, algo: AlgorithmConfig, chosen: dict[str, Any]) -> list[Problem]:
    try:
        settings_of(entry.settings, algo, chosen)
    except ValidationError as err:
        allowed = ", ".join(entry.settings.model_fields) or "none"
        problems = []
        for e in err.errors():
            field = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                message = (
                    f"{key}.{field} ({e['input']!r}) must be a setting of {entry.name} because the entry reads "
                    f"only its own settings (its settings: {allowed}); remove it (docs/algorithms.md)"
                )
            else:
                reason = " ".join(e["msg"].split()).removeprefix("Input should ")
                message = f"{key}.{field} ({e['input']!r}) must {reason[:1].lower()}{reason[1:]}"
            where = f"{key}.{field}" if field in chosen else f"algorithm.{field}"
            problems.append((where, message))
        return problems
    return []


def _requirement_problems(cfg: RunConfig, estimator: Any) -> list[Problem]:
    algo, critic, name = cfg.algorithm, cfg.critic, cfg.algorithm.estimator_name
    problems = []
    if estimator.needs_whitening and not algo.normalize_advantages:
        problems.append(
            (
                "algorithm.normalize_advantages",
                f"algorithm.normalize_advantages (False) must be true for advantage_estimator {name} because it "
                "uses batch whitening as its baseline; set algorithm.normalize_advantages: true",
            )
        )
    if estimator.needs_critic and critic.config is None and algo.custom_advantage is None:
        problems.append(
            (
                "algorithm.advantage_estimator",
                f"algorithm.advantage_estimator ({name}) must come with algorithm.custom_advantage or critic.config "
                "because its advantages need critic values; set critic.config: configs/critic/smollm2.yaml",
            )
        )
    if critic.config is not None and not estimator.needs_critic and algo.custom_advantage is None:
        problems.append(
            (
                "critic.config",
                f"critic.config ('{critic.config}') must be unset for advantage_estimator {name} because only a "
                "critic-based estimator (ppo) or a custom_advantage reads the values; set "
                "algorithm.advantage_estimator: ppo or remove critic.config",
            )
        )
    return problems
