"""The policy losses, one module each (its settings, its function, its ``ENTRY``), and the one table of them.

A new loss is a new module here with ``Settings``, a function ``(settings, PolicyInputs) -> PolicyLossTerms``
and ``ENTRY = PolicyLoss(...)``, plus its line below. The modules import torch only inside their
functions, so ``rlrun config validate`` reads this table without torch.
"""

from __future__ import annotations

from rlrun.algo.entries import PolicyLoss
from rlrun.algo.losses import cispo, gspo, opsm, ppo_clip

POLICY_LOSSES: dict[str, PolicyLoss] = {
    entry.name: entry for entry in (ppo_clip.ENTRY, gspo.ENTRY, cispo.ENTRY, opsm.ENTRY)
}
"""``algorithm.policy_loss``'s names -> their entries."""
