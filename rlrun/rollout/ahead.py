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

With ``engine.max_restarts`` a rollout whose engine was lost raises :class:`RolloutLost`; the thread then
runs nothing more (the rollouts queued behind it raise it too), the caller restarts the engine while the
thread is idle and calls :meth:`RolloutAhead.redo`: the lost rollout and those launched after it run again,
each under the weights the schedule gave it. Those weights are still here (``keep_loaded``: published
weights are kept until a rollout under newer ones starts, not only until they are pushed), so a restarted
engine, or a live one that already moved to a later segment's weights, is loaded with them first.

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


class RolloutLost(RuntimeError):
    """A rollout's engine was lost (``engine.max_restarts``): the schedule stopped at ``step``, whose rollout and
    the later ones are to be redone after the restart (:meth:`RolloutAhead.redo`)."""

    def __init__(self, step: int, cause: str) -> None:
        super().__init__(f"step {step}'s rollout lost its engine: {cause}")
        self.step = step


class RolloutAhead(Generic[B]):
    """Step-ordered rollouts on one background thread, each started as early as ``max_staleness`` allows.

    ``collect(step)`` produces step ``step``'s batch (collective over the rollout process group: every rank
    must launch the same steps; it raises :class:`RolloutLost` on every rank alike); ``push(published)`` loads
    published weights into the engine. Both run on the background thread only. ``start`` is what the engine
    holds when the schedule starts, the weights trained through ``first_step - 1``: kept (as published by that
    step) with ``keep_loaded``, whose redo may need them again."""

    def __init__(
        self,
        collect: Callable[[int], B],
        push: Callable[[Published], None],
        max_staleness: int,
        first_step: int,
        end_step: int,
        start: Published | None = None,
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
        self.keep_loaded = start is not None
        """Keep the weights the engine holds until a rollout under newer ones starts (``engine.max_restarts``:
        a redo loads them again), instead of dropping them once pushed."""
        self._futures: dict[int, Future[B]] = {}
        self._published: dict[int, Published] = {}  # step -> the weights trained up to and including it
        if start is not None:
            self._published[first_step - 1] = start
        self._trained_through = first_step - 1
        """The last step the trainer finished (published its weights, or had none to publish); the engine
        already holds the weights of the steps before ``first_step``."""
        self._first_step = first_step
        self._loaded: int | None = first_step - 1
        """The step whose published weights the engine holds (None: unknown, after a restart)."""
        self._lost_at: int | None = None
        """The step whose rollout raised ``RolloutLost``: nothing runs until :meth:`redo`."""
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
        # Below the schedule's first step, every bound means the weights the engine started with.
        bound = max(step - self.max_staleness - 1 + segment, self._first_step - 1)
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._trained_through >= bound)
            if self._closed:
                raise RuntimeError(f"step {step}'s rollout stopped waiting for step {bound}'s weights: closed")
            ready = [s for s in self._published if s <= bound]
            # None ready (only without keep_loaded, which keeps the newest): the engine holds them already.
            newest = max(ready) if ready else None
            weights = self._published[newest] if newest is not None and newest != self._loaded else None
            if not self.keep_loaded:
                drop = ready
            elif segment == 0 and newest is not None:  # segment 1 keeps segment 0's weights: a redo starts there
                drop = [s for s in ready if s < newest]
            else:
                drop = []
            for s in drop:
                del self._published[s]
        if weights is not None:
            self.push(weights)
            self._loaded = newest

    def drain(self) -> dict[int, B]:
        """Wait until no rollout runs (the engine is free for eval or a checkpoint); the launched batches
        (raises :class:`RolloutLost` if one lost its engine)."""
        self.wait_idle()
        return {step: future.result() for step, future in sorted(self._futures.items())}

    def wait_idle(self) -> None:
        """Wait until every launched rollout has finished (after :class:`RolloutLost`, the ones behind it
        raise it at once: nothing runs on the engine or the rollout group)."""
        wait(list(self._futures.values()))

    def redo(self, step: int, engine_restarted: bool) -> None:
        """After :class:`RolloutLost` for ``step``, :meth:`wait_idle` and the engine's restart: launch ``step``'s
        rollout and the later ones launched before, again. ``engine_restarted``: this rank's engine is a fresh
        worker, so the rollout first loads its weights (kept: ``start`` stands for the weights the engine started
        with, also when they were ``model.path``'s)."""
        assert self._lost_at == step, f"redo of step {step} but the schedule stopped at {self._lost_at}"
        assert all(f.done() for f in self._futures.values()), "redo while a rollout runs"
        end, self.next_step, self._lost_at = self.next_step, step, None
        if engine_restarted:
            self._loaded = None
        for s in [s for s in self._futures if s >= step]:
            del self._futures[s]
        while self.next_step < end:
            self._futures[self.next_step] = self._pool.submit(self._run, self.next_step)
            self.next_step += 1

    def close(self) -> None:
        """Stop: rollouts not started are cancelled; a running one is not waited for (after a failure it may
        wait on a peer that is gone; the watchdog ends the process); one waiting for weights raises."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, step: int) -> B:
        if self._lost_at is not None:  # an earlier rollout lost its engine: nothing runs until the redo
            raise RolloutLost(self._lost_at, "an earlier rollout of the schedule lost it")
        try:
            self.enter_segment(step, 0)
            return self.collect(step)
        except RolloutLost:
            self._lost_at = step
            raise


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
