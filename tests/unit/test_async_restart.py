"""``RolloutAhead`` after a lost engine (``engine.max_restarts``): the schedule stops at the lost rollout, and the
redo samples every step with the weights an uninterrupted schedule gives it (step m: the newest trained
through step m - K - 1; with continuation, its second segment: through step m - K), whatever the restarted
or the live engine held when the loss happened."""

from __future__ import annotations

import pytest

from rlrun.rollout.ahead import Published, RolloutAhead, RolloutLost

FRESH = -1
"""What a restarted engine holds: none of the published versions."""


class FakeRun:
    """A fake trainer and engine over the real schedule: a rollout returns the versions its segments sampled
    with; ``lose`` = {step: segment} loses the engine once in that segment of that step's rollout."""

    def __init__(self, k: int, num_steps: int, segments: int = 1, lose: dict[int, int] | None = None) -> None:
        self.engine_version = 0
        self.pushes: list[int] = []
        self.lose = dict(lose or {})
        self.segments = segments
        self.ahead = RolloutAhead(self.collect, self.push, k, 0, num_steps, start=Published(0, "initial"))

    def push(self, published: Published) -> None:
        self.pushes.append(published.version)
        self.engine_version = published.version

    def collect(self, step: int) -> tuple[int, ...]:
        sampled = [self.engine_version]
        for segment in range(1, self.segments):
            self.ahead.enter_segment(step, segment)
            sampled.append(self.engine_version)
        if step in self.lose:
            self.engine_version = FRESH if self.lose.pop(step) == 0 else self.engine_version
            raise RolloutLost(step, "engine worker killed")
        return tuple(sampled)

    def train(self, num_steps: int) -> list[tuple[int, ...]]:
        sampled, redone = [], []
        for step in range(num_steps):
            self.ahead.launch_until(step)
            while True:
                try:
                    sampled.append(self.ahead.take(step))
                    break
                except RolloutLost as lost:
                    self.ahead.wait_idle()
                    redone.append(lost.step)
                    restarted = self.engine_version == FRESH
                    self.ahead.redo(lost.step, engine_restarted=restarted)
            self.ahead.publish(step, Published(step + 1, f"trained through {step}"))
        self.ahead.close()
        self.redone = redone
        return sampled


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("lost_step", [0, 1, 4])
def test_a_lost_rollout_is_redone_with_the_weights_it_was_given(k, lost_step):
    want = FakeRun(k, 7).train(7)
    run = FakeRun(k, 7, lose={lost_step: 0})
    assert run.train(7) == want
    assert run.redone == [lost_step]
    # the restarted engine loads the lost rollout's weights first (the initial ones included: kept as published)
    assert run.pushes.count(max(0, lost_step - k)) == 2 - (max(0, lost_step - k) == 0)


def test_a_redo_reloads_segment_0_weights_on_an_engine_that_moved_to_segment_1():
    """K = 2 with continuation: lost in step 4's second segment, the live engine holds the weights trained
    through step 2; the redo samples segment 0 with those through step 1 again, then segment 1 as before."""
    want = FakeRun(2, 7, segments=2).train(7)
    assert want[4] == (2, 3)
    run = FakeRun(2, 7, segments=2, lose={4: 1})
    assert run.train(7) == want
    assert run.pushes[run.pushes.index(3) + 1 : run.pushes.index(3) + 3] == [2, 3]  # segment 0's, then 1's again


def test_rollouts_behind_the_lost_one_run_nothing_until_the_redo():
    ran: list[int] = []

    def collect(step: int) -> int:
        ran.append(step)
        if step == 1 and ran.count(1) == 1:
            raise RolloutLost(step, "engine worker killed")
        return step

    ahead = RolloutAhead(collect, lambda p: None, 2, 0, 5, start=Published(0, "initial"))
    ahead.launch_until(0)  # steps 0, 1, 2
    assert ahead.take(0) == 0
    with pytest.raises(RolloutLost) as lost:
        ahead.drain()
    assert lost.value.step == 1 and ran == [0, 1]  # step 2 was skipped: it raised the same loss
    ahead.redo(1, engine_restarted=True)
    assert ahead.drain() == {1: 1, 2: 2} and ran == [0, 1, 1, 2]
    ahead.close()
