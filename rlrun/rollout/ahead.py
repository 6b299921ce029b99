"""Rollouts generated ahead of training, under a bound on the weights' age (``rollout.max_staleness``).

Step ``m``'s rollout may start once the weights trained up to step ``m - K - 1`` are published, so it
samples with weights at most ``K`` updates older than the ones that train on it. One background thread
runs the rollouts in step order; before step ``m``'s it pushes the newest weights published for a step
``<= m - K - 1`` into the engine, so which weights sample which step never depends on timing:

    K = 1   main thread:  [train n-1][publish w_n][train n  ][publish w_n+1][train n+1] ...
            rollout thread:    [push w_n-1, rollout n][push w_n, rollout n+1][push w_n+1, rollout n+2]

With ``rollout.continue_after_tokens`` (K >= 2) a rollout runs in two segments (rlrun/rollout/segments.py):
its responses' first tokens under the weights above, then its unfinished samples continue under the
newest ones published for a step ``<= m - K``, the update the trainer publishes while the rollout runs;
:meth:`RolloutAhead.enter_segment` waits until the trainer is through that step. Both bounds are steps the
trainer has finished by the time it checkpoints after step ``m - K``, so a checkpoint's :meth:`drain` never
waits on a step not yet trained.

The thread owns the engine client between :meth:`RolloutAhead.launch_until` and :meth:`RolloutAhead.drain`
(a ZeroMQ socket serves one thread at a time); its collectives run on a process group of their own, so
they never interleave with the trainer's. Nothing here imports torch.distributed: the caller passes the
two functions that touch ranks and engines, which lets a benchmark drive the same schedule.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

B = TypeVar("B")


@dataclass(frozen=True)
class Published:
    """Weights the trainer published after a step: the engine's version string and what ``push`` sends."""

    version: int
    weights: Any


class RolloutAhead(Generic[B]):
    """Step-ordered rollouts on one background thread, each started as early as ``max_staleness`` allows.

    ``collect(step)`` produces step ``step``'s batch (collective over the rollout process group: every rank
    must launch the same steps); ``push(published)`` loads published weights into the engine. Both run on the
    background thread only."""

    def __init__(
        self,
        collect: Callable[[int], B],
        push: Callable[[Published], None],
        max_staleness: int,
        first_step: int,
        end_step: int,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"rollout.max_staleness ({max_staleness}) must be >= 1 to generate ahead")
        # settings
        self.collect = collect
        self.push = push
        self.max_staleness = max_staleness
        self.end_step = end_step
        """No rollout is launched for this step or later ones (the run's last step + 1)."""
        # the schedule
        self.next_step = first_step
        """The first step whose rollout is not launched yet."""
        self._futures: dict[int, Future[B]] = {}
        self._published: dict[int, Published] = {}  # step -> the weights trained up to and including it
        self._trained_through = first_step - 1
        """The last step the trainer finished (published its weights, or had none to publish); the engine
        already holds the weights of the steps before ``first_step``."""
        self._closed = False
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")

    def launch_until(self, step: int) -> None:
        """Call at step ``step``'s start, after the previous step published: launch every rollout the bound
        allows now (steps up to ``step + max_staleness``)."""
        while self.next_step <= min(step + self.max_staleness, self.end_step - 1):
            self._futures[self.next_step] = self._pool.submit(self._run, self.next_step)
            self.next_step += 1

    def take(self, step: int) -> B:
        """Step ``step``'s batch, waiting for it (re-raises the rollout's error)."""
        return self._futures.pop(step).result()

    def put(self, step: int, batch: B) -> None:
        """A batch produced elsewhere (a resumed checkpoint's) stands for step ``step``'s rollout."""
        done: Future[B] = Future()
        done.set_result(batch)
        self._futures[step] = done
        self.next_step = max(self.next_step, step + 1)

    def publish(self, step: int, published: Published | None) -> None:
        """Call at every step's end: the trainer's weights after step ``step`` (None: the step changed none).
        The rollout of step ``step + max_staleness + 1`` pushes them (or newer ones) first. The caller must not
        change ``published.weights`` afterwards."""
        with self._cond:
            if published is not None:
                self._published[step] = published
            self._trained_through = step
            self._cond.notify_all()

    def enter_segment(self, step: int, segment: int) -> None:
        """On the rollout thread: load the weights that segment ``segment`` of step ``step``'s rollout samples
        with, the newest published for a step ``<= step - max_staleness - 1 + segment``, after waiting until
        the trainer is through that step (segment 0's bound is always through when the rollout launches)."""
        bound = step - self.max_staleness - 1 + segment
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._trained_through >= bound)
            if self._closed:
                raise RuntimeError(f"step {step}'s rollout stopped waiting for step {bound}'s weights: closed")
            ready = [s for s in self._published if s <= bound]
            newest = self._published[max(ready)] if ready else None
            for s in ready:
                del self._published[s]
        if newest is not None:
            self.push(newest)

    def drain(self) -> dict[int, B]:
        """Wait until no rollout runs (the engine is free for eval or a checkpoint); the launched batches."""
        wait(list(self._futures.values()))
        return {step: future.result() for step, future in sorted(self._futures.items())}

    def close(self) -> None:
        """Stop: rollouts not started are cancelled; a running one is not waited for (after a failure it may
        wait on a peer that is gone; the watchdog ends the process); one waiting for weights raises."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, step: int) -> B:
        self.enter_segment(step, 0)
        return self.collect(step)


def versions_behind(trainer_version: int, spans: list[list[tuple[str, int]]]) -> dict[str, float]:
    """``rollout/versions_behind_{mean,max}`` from each sample's ``(weight_version, num_tokens)`` spans: how many
    versions the trainer's weights are ahead of the ones that sampled each token; ``_mean`` averages each
    sample's tokens, then the samples; ``_max`` is the oldest token's (an engine that was never synced reports
    a non-number: version 0)."""
    if not spans:
        return {}
    per_sample = []
    for sample_spans in spans:
        behind = [(trainer_version - (int(v) if v.isdigit() else 0), n) for v, n in sample_spans]
        num_tokens = sum(n for _, n in behind)
        mean = sum(b * n for b, n in behind) / num_tokens if num_tokens else behind[-1][0]
        per_sample.append((mean, max(b for b, _ in behind)))
    return {
        "rollout/versions_behind_mean": sum(mean for mean, _ in per_sample) / len(per_sample),
        "rollout/versions_behind_max": max(worst for _, worst in per_sample),
    }
