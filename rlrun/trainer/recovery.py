"""Engine restart in place (``engine.max_restarts``): a lost engine costs one rollout, not the job.

An engine group that tolerates loss (rlrun/engine/group.py) records a dead or silent engine in
``EngineGroup.lost`` and keeps every collective of the step in order; the loop then calls
:meth:`EngineRecovery.recover` at two points of the step, on every rank::

    after the rollout   lost? -> restart, re-sync the current weights, redo the step's rollout
                                 (rank 0's sampler rewound: the same prompts, the same seeds)
    after the sync      lost? -> restart, re-sync the weights just trained; the step stands

``recover`` is collective: every rank learns which groups lost their engine (one gloo all-gather), the
ranks of those groups restart theirs (the leader spawns, the members wait for it: a group restarts as a
group), every rank takes part in the re-sync's export (its TP/PP collectives), only restarted groups
send it, and a monitored barrier bounds how long the others wait for the restarted ones
(``engine.startup_timeout_s`` plus a margin; past it the barrier names the ranks that did not arrive).
Restarts are counted over the whole job (all ranks agree on the count); the one past
``engine.max_restarts`` ends the job with the loss's one-line cause, as without restarts.

With rollouts generated ahead (``rollout.max_staleness`` > 0) the loss surfaces on the rollout thread and
rlrun/trainer/ahead_step.py calls :meth:`EngineRecovery.recover` once that thread is idle; its re-sync only
marks the restarted engine, which the thread then loads with the lost rollout's weights before redoing it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from rlrun.data.transfer import all_gather
from rlrun.engine.group import EngineGroup
from rlrun.runtime.dist import Parallel
from rlrun.trainer.offload import Offloader

log = logging.getLogger(__name__)

BARRIER_MARGIN_S = 120.0
"""Beyond ``engine.startup_timeout_s``: the re-sync and a rank's way to the barrier."""


class EngineLostError(RuntimeError):
    """An engine was lost with no restart left (``engine.max_restarts``)."""


class EngineRecovery:
    """This rank's side of restarting lost engines; see the module docstring."""

    def __init__(
        self,
        max_restarts: int,
        startup_timeout_s: float,
        engine: EngineGroup,
        offloader: Offloader,
        parallel: Parallel,
    ) -> None:
        self.max_restarts = max_restarts
        self.barrier_timeout = timedelta(seconds=startup_timeout_s + BARRIER_MARGIN_S)
        self.engine = engine
        self.offloader = offloader
        self.parallel = parallel

        self.restarts = 0
        """Engines restarted so far in this job (every rank holds the same count)."""
        self.restart_s = 0.0
        """Wall seconds spent restarting and re-syncing, this step (rank 0 logs it)."""

    def recover(self, step: int, phase: str, resync: Callable[[bool], None]) -> bool:
        """Collective: restart every lost engine and re-sync it with ``resync`` (True: this rank's group
        restarted and sends the weights; False: it only takes part in the export); whether any was lost.
        Raises ``EngineLostError`` on every rank once the restarts would exceed ``engine.max_restarts``."""
        if self.max_restarts == 0:  # nothing tolerates a loss: a lost engine has raised already
            return False
        losses = all_gather(self.engine.lost, self.parallel.cpu_group)
        lost_leaders = {group[0] for group in self.engine.layout.all_groups() if any(losses[r] for r in group)}
        if not lost_leaders:
            return False
        start = time.perf_counter()
        causes = "; ".join(sorted({why for why in losses if why}))
        self.restarts += len(lost_leaders)
        if self.restarts > self.max_restarts:
            raise EngineLostError(
                f"{causes} (step {step}, {phase}); engine.max_restarts ({self.max_restarts}) are used up, so "
                "the job ends; raise engine.max_restarts to restart more often"
            )
        restarting = self.engine.layout.leader in lost_leaders
        if restarting or self.parallel.is_rank0:
            log.warning(
                "[rlrun] rank %d: restarting the engine of rank(s) %s at step %d (%s; restart %d of %d): %s",
                self.parallel.rank,
                self.engine.engine_ranks(sorted(lost_leaders)),
                step,
                phase,
                self.restarts,
                self.max_restarts,
                causes,
            )
        if restarting:
            self.engine.restart()
        self.offloader.engine_restarted(restarting)
        resync(restarting)
        dist.monitored_barrier(self.parallel.cpu_group, timeout=self.barrier_timeout, wait_all_ranks=True)
        self.restart_s += time.perf_counter() - start
        return True

    def step_metrics(self) -> dict[str, float]:
        """``engine/restarts`` (so far, this job) and ``engine/restart_s`` (this step), then reset the latter;
        nothing without restarts."""
        if self.max_restarts == 0:
            return {}
        out = {"engine/restarts": float(self.restarts), "engine/restart_s": round(self.restart_s, 3)}
        self.restart_s = 0.0
        return out
