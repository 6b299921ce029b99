"""Metrics sinks: metrics.jsonl across a resume, TensorBoard events read back with TensorBoard's own
reader (purged on resume), the console summary, and phase notifications."""

from __future__ import annotations

import json
import time

import pytest

from minimal_config import run_config
from rlrun.config.schema import RunConfig
from rlrun.observability.metrics import JsonlSink, MetricsLogger, PhaseTimer, TensorBoardSink


def config(tmp_path, **logging) -> RunConfig:
    return run_config({"logging": {"run_dir": str(tmp_path), **logging}, "train": {"num_steps": 5}})


def test_jsonl_resume_drops_the_steps_that_run_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, start_step=0)
    for step in range(5):
        sink.write(step, {"x": float(step)})
    resumed = JsonlSink(path, start_step=3)
    resumed.write(3, {"x": 30.0})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"step": 0, "x": 0.0}, {"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 3, "x": 30.0}]
    JsonlSink(path, start_step=0)
    assert path.read_text() == ""


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir, start_step=0)
    for step in range(5):
        sink.write(step, {"rollout/reward_mean": 0.1 * step})
    sink.close()
    resumed = TensorBoardSink(log_dir, start_step=3)
    resumed.write(3, {"rollout/reward_mean": 9.0})
    resumed.close()
    events = EventAccumulator(str(log_dir))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")]
    assert got == [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, 9.0)]


def test_logger_writes_jsonl_and_prints_one_summary_line_per_step(tmp_path, capsys):
    logger = MetricsLogger(config(tmp_path))
    logger.start(0)
    time.sleep(0.2)
    logger.log(0, {"rollout/reward_mean": 0.25, "train/policy_loss": -0.5, "time/step_s": 1.5})
    logger.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert 0.2 <= record.pop("time/wall_step_s") < 5  # the wall clock since start(), whatever the phases said
    assert record == {
        "step": 0,
        "rollout/reward_mean": 0.25,
        "train/policy_loss": -0.5,
        "time/step_s": 1.5,
    }
    line = capsys.readouterr().out.strip()
    assert line.startswith("step 1/5  reward 0.250") and "loss -0.5000" in line and "1.5s" in line


def test_phase_timer_reports_phase_starts_and_sums_repeated_phases():
    class Listener:
        def __init__(self):
            self.phases = []

        def phase_started(self, phase):
            self.phases.append(phase)

    listener = Listener()
    timer = PhaseTimer(listener)
    for phase in ("rollout", "offload", "train", "offload"):
        with timer(phase):
            pass
    assert listener.phases == ["rollout", "offload", "train", "offload"]
    metrics = timer.as_metrics()
    assert set(metrics) == {"time/rollout_s", "time/offload_s", "time/train_s", "time/step_s"}
    assert metrics["time/step_s"] == pytest.approx(sum(v for k, v in metrics.items() if k != "time/step_s"), abs=1e-3)


def test_missing_wandb_is_a_config_error_naming_the_key(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    logger = MetricsLogger(config(tmp_path, wandb_project="demo", console=False))
    with pytest.raises(ValueError, match=r"logging.wandb_project \('demo'\) needs the wandb package"):
        logger.start(0)


def test_profiler_traces_only_the_chosen_step_with_phases_as_ranges(tmp_path):
    import torch

    from rlrun.observability.profiler import profile_step, trace_path

    cfg = config(tmp_path, profile_steps=[1], profile_ranks=[0]).logging
    for step in (0, 1):
        with profile_step(cfg, rank=0, step=step):
            timer = PhaseTimer()
            with timer("train"):
                torch.ones(64, 64) @ torch.ones(64, 64)
    with profile_step(cfg, rank=1, step=1):
        pass
    assert not trace_path(tmp_path, 0, 0).exists() and not trace_path(tmp_path, 1, 1).exists()
    events = json.loads(trace_path(tmp_path, 1, 0).read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "train" in names and any("mm" in str(n) for n in names)
