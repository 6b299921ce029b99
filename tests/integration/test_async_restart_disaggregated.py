"""``engine.max_restarts`` with rollouts generated ahead on an engine rank (``placement.engine_ranks``,
``rollout.max_staleness`` 1) through the real CLI under torchrun: 1 training rank (Megatron on gloo) and 1 engine
rank (embedded engine over ZMQ). The engine rank's worker is SIGKILLed on the rollout thread's watch; asserted on
metrics.jsonl against a run without the kill."""

from __future__ import annotations

import re

import pytest
from test_disaggregated import (
    ASYNC,
    ENGINE_RANK,
    assert_restart_counted_and_metrics_equal,
    numbers,
    run,
    run_with_worker_killed,
)
from test_resume import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.parametrize("point", ["rpc.generate", "rpc.update_weights_from_tensor"], ids=["generate", "push"])
def test_engine_rank_worker_killed_with_rollouts_ahead_matches_uninterrupted_run(tiny_model_dirs, tmp_path, point):
    """K = 1, ``engine.max_restarts: 1``: the engine rank's worker is SIGKILLed as a generate (or a weight bucket
    pushed before a rollout) arrives. Rank 0's rollout thread hears of it in the engine rank's reply, the main
    thread restarts the worker through the engine rank, the rollout thread loads the lost rollout's weights into
    it and redoes the rollout: every step logged once, the restart counted from its step, every other metric
    within 1e-5 of a run without the kill."""
    model, num_steps = tiny_model_dirs["qwen3"], 5
    settings = [f"train.num_steps={num_steps}", "engine.max_restarts=1", *ENGINE_RANK, *ASYNC]
    reference = [numbers(r) for r in run(model, tmp_path / "reference", 2, *settings)]
    run_dir = tmp_path / "killed"
    code, output = run_with_worker_killed(model, run_dir, tmp_path / "faults", 2, settings, point)
    assert code == 0, output[-5000:]
    restarted = re.search(
        r"\[rlrun\] rank 0: restarting the engine of rank\(s\) \[\d\] at step (\d+) \(rollout ahead;", output
    )
    assert restarted, output[-5000:]
    lost_in = "rollout" if point == "rpc.generate" else "sync"
    assert f"engine of rank 1 lost in {lost_in}: RpcPeerDiedError" in output, output[-5000:]
    assert (run_dir / "engine-1.restart1.log").exists()
    assert_restart_counted_and_metrics_equal(read_metrics(run_dir), reference, int(restarted[1]))
