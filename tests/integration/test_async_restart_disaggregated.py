"""``engine.max_restarts`` with rollouts generated ahead on an engine rank (``placement.engine_ranks``,
``rollout.max_staleness`` 1) through the real CLI under torchrun: 1 training rank (Megatron on gloo) and 1 engine
rank (embedded engine over ZMQ). The engine rank's worker is SIGKILLed on the rollout thread's watch; asserted on
metrics.jsonl against a run without the kill."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from test_disaggregated import ASYNC, ENGINE_RANK, command, numbers, run
from test_resume import read_metrics, train_env

from rlrun.runtime.fault_points import DIR_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from faults import Job, arm, engine_pids, wait_fired, wait_for_steps  # noqa: E402


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
    run_dir, fault_dir = tmp_path / "killed", tmp_path / "faults"
    fault_dir.mkdir()
    job = Job(command(model, run_dir, 2, *settings), {**train_env(), DIR_ENV: str(fault_dir)})
    try:
        wait_for_steps(run_dir, 1, job.proc, timeout_s=300)
        worker = engine_pids(job.proc.pid)
        assert list(worker) == [1], worker  # the engine rank's worker; the training rank has none
        arm(fault_dir, worker[1], point, "SIGKILL")
        wait_fired(fault_dir, worker[1], point, job.proc)
        code = job.wait(timeout_s=300)
    finally:
        job.kill()
    output = "\n".join(line for _, line in job.lines)
    assert code == 0, output[-5000:]
    restarted = re.search(
        r"\[rlrun\] rank 0: restarting the engine of rank\(s\) \[\d\] at step (\d+) \(rollout ahead;", output
    )
    assert restarted, output[-5000:]
    step = int(restarted[1])
    lost_in = "rollout" if point == "rpc.generate" else "sync"
    assert f"engine of rank 1 lost in {lost_in}: RpcPeerDiedError" in output, output[-5000:]
    assert (run_dir / "engine-1.restart1.log").exists()
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(num_steps)), output[-5000:]
    assert [m["engine/restarts"] for m in metrics] == [float(s >= step) for s in range(num_steps)]
    for got, want in zip(metrics, reference, strict=True):
        got = {k: v for k, v in numbers(got).items() if not k.startswith("engine/")}
        want = {k: v for k, v in want.items() if not k.startswith("engine/")}
        assert got.keys() == want.keys(), got.keys() ^ want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (got["step"], key, got[key], value)
