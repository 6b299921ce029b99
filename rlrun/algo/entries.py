"""What an advantage estimator and a policy loss are: one entry each, its function and its own settings.

An entry's ``settings`` is a pydantic model declared next to its function; the config names the entry
(``algorithm.policy_loss: gspo``) or names it with settings (``{name: opsm, delta: 1e-3}``). The
``algorithm`` section's flat fields that old configs use (``eps_clip``, ``normalize_std``, ``gamma``, ...)
are the defaults of the settings of the same name, in every entry that has one; a key in the mapping
wins over them (``settings_of``). The tables that hold the entries are ``rlrun.algo.estimators.ESTIMATORS``
and ``rlrun.algo.losses.POLICY_LOSSES``; ``rlrun.algo.specs`` chooses from them.

Imports no torch: ``rlrun config validate`` builds the settings to check them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

    from rlrun.algo.policy_loss import PolicyLossTerms
    from rlrun.config.schema import AlgorithmConfig

GroupBaseline = Literal["normalised", "mean", "leave_one_out", "none"]
"""normalised: (r - mean) / (std + eps) (setting ``normalize_std`` false drops the std); mean: r - mean;
leave_one_out: r_i - mean of the group's other rewards; none: r (the baseline comes later: whitening or
the critic)."""
TokenStage = Literal["per_sample", "returns", "gae"]
"""per_sample: the score on every response token; returns: discounted returns of the score at the last
token; gae: generalised advantage estimation with the critic's values."""


class Settings(BaseModel):
    """Base of every entry's settings: frozen, and a key the entry does not have is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class NoSettings(Settings):
    """An entry without settings of its own."""


class ClipSettings(Settings):
    """The clip ranges of the PPO-clip family (PPO-clip, GSPO, OPSM)."""

    eps_clip: float = Field(0.2, gt=0)
    """Lower clip range: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Upper clip range (clip-higher, DAPO arXiv 2503.14476); None uses ``eps_clip``."""
    eps_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant c > 1 (arXiv 1912.09729): a negative-advantage token's loss is at most c * |A|.
    None disables."""

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


@dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss reads; per-token tensors are ``[B, T]``."""

    logprobs: torch.Tensor
    """The training forward's log-probs (with gradient)."""
    old_logprobs: torch.Tensor
    """The old policy's: the ratio's denominator (the engine's with ``use_rollout_logprobs``)."""
    rollout_logprobs: torch.Tensor
    """The engine's, at sampling time: the behaviour policy."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """1.0 on the response tokens that train."""
    sample_ids: torch.Tensor | None
    """Which sample each position belongs to (``rlrun.algo.segments``); None: one sample per row."""


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss: ``terms(settings, inputs)`` gives per-token tensors, masked and aggregated later."""

    name: str
    settings: type[Settings]
    terms: Callable[[Any, PolicyInputs], PolicyLossTerms]
    reuses_logprobs: bool
    """Whether the training forward's own detached log-probs may stand in for the old policy's (GSPO's
    sequence ratio needs the whole old sequence before training, as in slime)."""
    summary: str
    """One line for docs and errors: what the loss is, with its paper."""


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator: a rank-0 group baseline (rewards of a group -> one score per response),
    a per-rank token stage (scores + KL penalty -> per-token advantages) and the policy loss it implies
    when ``algorithm.policy_loss`` is unset. The stages' math: ``advantages.GROUP_BASELINES``,
    ``rank_advantages.TOKEN_STAGES``."""

    name: str
    settings: type[Settings]
    baseline: GroupBaseline
    """Rank 0, before the scatter: how a group's rewards become one score per response."""
    token_stage: TokenStage
    """Each rank, after the log-probs: how a response's score becomes per-token advantages."""
    policy_loss: str
    """The loss used when ``algorithm.policy_loss`` is unset (the estimator's paper's)."""
    summary: str
    needs_critic: bool = False
    """Reads the critic's values (``critic.config`` required)."""
    needs_whitening: bool = False
    """Batch whitening is its baseline (``algorithm.normalize_advantages`` required)."""


def settings_of(settings: type[Settings], cfg: AlgorithmConfig, chosen: dict[str, Any]) -> Any:
    """The entry's settings: its defaults, overridden by the ``algorithm`` section's flat fields of the same
    name, overridden by the keys of the entry's mapping (``chosen``). Raises pydantic's ValidationError."""
    shared = {name: getattr(cfg, name) for name in settings.model_fields if name in type(cfg).model_fields}
    return settings.model_validate({**shared, **chosen})
