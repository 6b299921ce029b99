"""CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): the clipped ratio is a stop-gradient weight,

    loss = -sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp

so clipped tokens still get gradient through ``logp``. Canonical CISPO has no lower bound (``eps_clip >= 1``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from rlrun.algo.entries import PolicyInputs, PolicyLoss
from rlrun.algo.entries import Settings as EntrySettings

if TYPE_CHECKING:
    from rlrun.algo.policy_loss import PolicyLossTerms


class Settings(EntrySettings):
    eps_clip: float = Field(0.2, gt=0)
    """Lower bound of the weight: 1 - eps_clip (>= 1: none, as in the paper)."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Upper bound of the weight: 1 + eps_clip_high; None uses ``eps_clip``."""

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def terms(settings: Settings, x: PolicyInputs) -> PolicyLossTerms:
    from rlrun.algo.policy_loss import cispo_loss  # torch only when training: config validation reads ENTRY

    return cispo_loss(x.logprobs, x.old_logprobs, x.advantages, settings.eps_clip, settings.clip_high)


ENTRY = PolicyLoss("cispo", Settings, terms, reuses_logprobs=True, summary="the clipped, detached IS weight times logp")
