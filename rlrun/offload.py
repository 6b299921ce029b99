"""Turn-taking between the trainer and the engine on the same device.

The call sites are the same on every device so the loop reads the same everywhere; on CPU there is
no device memory to give back, so the trainer's sleep/wake do nothing and the engine's
release/resume only run the contract's bookkeeping (which still catches ordering mistakes).
"""

from __future__ import annotations

import torch

from rlrun.config.schema import OffloadConfig

ENGINE_TAGS_AFTER_SYNC = ["kv_cache", "cuda_graph"]


class Offloader:
    """Sleep/wake for one rank's trainer and its engine, in the order of DESIGN.md."""

    def __init__(self, cfg: OffloadConfig, engine, device: torch.device) -> None:
        self.cfg = cfg
        self.engine = engine
        self.device = device
        if cfg.train and device.type == "cuda":
            raise ValueError(
                "offload.train (true) must be false on GPU for now because trainer sleep via torch_memory_saver "
                "is not implemented yet; set offload.train=false"
            )

    def engine_sleep(self) -> None:
        """After rollout: the engine gives back weights, KV cache and graphs (never mid-request)."""
        if self.cfg.rollout:
            self.engine.release_memory_occupation()

    def engine_wake_for_sync(self) -> None:
        """Before weight sync: only the weights come back, the KV cache waits until after."""
        if self.cfg.rollout:
            self.engine.resume_memory_occupation(["weights"])

    def engine_wake_for_rollout(self) -> None:
        if self.cfg.rollout:
            self.engine.resume_memory_occupation(ENGINE_TAGS_AFTER_SYNC)

    def trainer_sleep(self) -> None:
        """Nothing to release on CPU; GPU sleep is rejected at construction until it exists."""

    def trainer_wake(self) -> None:
        """Counterpart of :meth:`trainer_sleep`."""
