"""The one place that chooses: the configured advantage estimator and policy loss, with their settings.

``algorithm.advantage_estimator`` and ``algorithm.policy_loss`` name an entry of ``ESTIMATORS`` /
``POLICY_LOSSES`` (``rlrun.algo.entries`` says what an entry is); an unset ``policy_loss`` is the
estimator's. Every other module asks here instead of comparing names. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlrun.algo.entries import Estimator, PolicyLoss, settings_of
from rlrun.algo.estimators import ESTIMATORS
from rlrun.algo.losses import POLICY_LOSSES
from rlrun.config.schema import RoutingReplayMode  # the routing-replay module reads the value set here

if TYPE_CHECKING:
    from rlrun.config.schema import AlgorithmConfig

__all__ = ["ESTIMATORS", "POLICY_LOSSES", "RoutingReplayMode", "estimator", "policy_loss"]


@dataclass(frozen=True)
class ChosenEstimator:
    entry: Estimator
    settings: Any
    """An instance of ``entry.settings``."""


@dataclass(frozen=True)
class ChosenLoss:
    entry: PolicyLoss
    settings: Any
    """An instance of ``entry.settings``."""


def estimator(cfg: AlgorithmConfig) -> ChosenEstimator:
    """The configured estimator and its settings (``entries.settings_of``)."""
    entry = entry_named(ESTIMATORS, cfg.estimator_name, "algorithm.advantage_estimator")
    return ChosenEstimator(entry, settings_of(entry.settings, cfg, cfg.estimator_settings))


def policy_loss_name(cfg: AlgorithmConfig) -> str:
    """``algorithm.policy_loss``'s name, or the estimator's loss when it is unset."""
    if cfg.policy_loss_name is not None:
        return cfg.policy_loss_name
    return entry_named(ESTIMATORS, cfg.estimator_name, "algorithm.advantage_estimator").policy_loss


def policy_loss(cfg: AlgorithmConfig) -> ChosenLoss:
    """The configured policy loss (the estimator's when unset) and its settings."""
    entry = entry_named(POLICY_LOSSES, policy_loss_name(cfg), "algorithm.policy_loss")
    return ChosenLoss(entry, settings_of(entry.settings, cfg, cfg.policy_loss_settings))


def entry_named(table: dict[str, Any], name: str, key: str) -> Any:
    if name not in table:
        raise ValueError(unknown_name(table, name, key))
    return table[name]


def unknown_name(table: dict[str, Any], name: str, key: str) -> str:
    return (
        f"{key} ({name}) must be one of {', '.join(table)} because those are the entries rlrun/algo defines; "
        f"set one of them (docs/algorithms.md)"
    )
