"""The rollout's optional user hooks, one row per ``rollout.<key>``: the loader that imports and checks it.

Read by the config's load-time check (``rlrun/config/load.py``: a bad path fails naming its key before any model
loads) and by ``RolloutHooks.load`` (``rlrun/rollout/collect.py``), so a new hook is one row here plus its field
there. The rewards are not rows: each named reward is checked under its own key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlrun.agents.runner import load_agent
from rlrun.config.schema import RolloutConfig
from rlrun.rollout.filters import load_filter
from rlrun.rollout.multiturn import load_generate_fn
from rlrun.rollout.rewards.post_process import load_reward_post_process
from rlrun.rollout.rollout_fn import RolloutFn
from rlrun.rollout.train_samples import SampleToTrain

HOOK_LOADERS: dict[str, Callable[[str], Any]] = {
    "generate_fn": load_generate_fn,
    "agent": load_agent,
    "reward_post_process": load_reward_post_process,
    "rollout_fn": RolloutFn.load,
    "sample_to_train": SampleToTrain.load,
    "dynamic_filter": load_filter,
}
"""``RolloutConfig`` field (a ``module:function`` or ``file.py:function`` path, or None) -> its loader."""


def load_hooks(r: RolloutConfig) -> dict[str, Any]:
    """Every hook ``r`` names, loaded (None for the unset ones); the loaders raise ``HookSpecError``."""
    return {key: load(getattr(r, key)) if getattr(r, key) else None for key, load in HOOK_LOADERS.items()}
