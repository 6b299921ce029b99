"""``RolloutAhead``: which weights sample which step, and when rollouts start, against the rule written out
by hand (step m samples with the newest weights trained up to step m - K - 1)."""

from __future__ import annotations

import threading
import time

import pytest

from minimal_config import run_config
from rlrun.rollout.ahead import Published, RolloutAhead, versions_behind


def drive(max_staleness: int, num_steps: int, train_s: float = 0.0, skip_publish: frozenset = frozenset()):
    """A fake trainer over the real schedule: each rollout returns the engine's version when it ran."""
    engine = {"version": 0}
    pushes: list[int] = []

    def push(published: Published) -> None:
        pushes.append(published.version)
        engine["version"] = published.version

    ahead = RolloutAhead(lambda step: (step, engine["version"]), push, max_staleness, 0, end_step=num_steps)
    sampled_with = []
    for step in range(num_steps):
        ahead.launch_until(step)
        got_step, version = ahead.take(step)
        assert got_step == step
        sampled_with.append(version)
        time.sleep(train_s)
        ahead.publish(step, None if step in skip_publish else Published(step + 1, None))
    assert ahead.next_step == num_steps  # nothing launched past the run's end
    ahead.close()
    return sampled_with, pushes


@pytest.mark.parametrize("k", [1, 2, 3])
def test_step_m_samples_with_weights_of_step_m_minus_k(k):
    sampled_with, pushes = drive(k, 8)
    # version v = weights trained through step v - 1; step m may use those through step m - k - 1
    assert sampled_with == [max(0, m - k) for m in range(8)]
    assert pushes == list(range(1, 8 - k))  # each published version pushed once, in order


def test_a_step_that_published_nothing_keeps_the_older_weights():
    sampled_with, _ = drive(1, 6, skip_publish=frozenset({2}))
    assert sampled_with == [0, 0, 1, 2, 2, 4]


def test_rollouts_overlap_training():
    """With K = 1 the rollout of step n + 1 starts while step n trains: each step's training waits, before it
    publishes, for the next rollout to have begun (without the overlap it begins only after the publish, and
    the wait runs out). Events, not timings: the machine's load cannot decide it."""
    started = {step: threading.Event() for step in range(4)}

    def collect(step):
        started[step].set()
        return step

    ahead = RolloutAhead(collect, lambda p: None, 1, 0, end_step=4)
    overlapped = []
    for step in range(4):
        ahead.launch_until(step)
        assert ahead.take(step) == step
        if step + 1 < 4:  # training step n
            overlapped.append(started[step + 1].wait(timeout=30))
        ahead.publish(step, Published(step + 1, None))
    ahead.close()
    assert overlapped == [True, True, True]


def test_versions_behind():
    assert versions_behind(3, [[("2", 5)], [("3", 1)], [("default", 0)]]) == {
        "rollout/versions_behind_mean": (1 + 0 + 3) / 3,
        "rollout/versions_behind_max": 3,
    }
    # a sample continued across an update: its tokens' mean (4 tokens 2 behind, 12 tokens 1 behind), its oldest
    assert versions_behind(3, [[("1", 4), ("2", 12)], [("1", 6)]]) == {
        "rollout/versions_behind_mean": ((4 * 2 + 12 * 1) / 16 + 2) / 2,
        "rollout/versions_behind_max": 2,
    }
    assert versions_behind(0, []) == {}


def test_max_staleness_0_is_the_synchronous_loop():
    with pytest.raises(ValueError, match="rollout.max_staleness"):
        RolloutAhead(lambda s: s, lambda p: None, 0, 0, end_step=1)


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ({"algorithm": {"max_logprob_gap": 1e-4}}, "algorithm.max_logprob_gap"),
        ({"engine": {"sync_interval": 2}}, "engine.sync_interval"),
        ({"rollout": {"max_staleness": 1, "partial_rollout": True}}, "rollout.partial_rollout"),
    ],
)
def test_config_refuses_what_the_rollout_thread_cannot_serve(setting, key):

    cfg = {"rollout": {"max_staleness": 1}}
    for section, values in setting.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        run_config(cfg)
    cfg["rollout"]["max_staleness"] = 0
    if key != "rollout.partial_rollout":
        run_config(cfg)  # the same settings are fine synchronously


def test_engine_restarts_load_with_rollouts_ahead():
    assert run_config({"rollout": {"max_staleness": 2}, "engine": {"max_restarts": 1}}).engine.max_restarts == 1
