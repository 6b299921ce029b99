"""benchmarks/verl_grpo.py's reading of verl's per-step metrics: medians after the warm-up steps, and a run that
reaches its time limit after the warm-up keeping the steps it logged (marked as stopped early).

verl is not installed here; the rows are what its ``file`` logger writes (``{"step": n, "data": {...}}``), and
the verl process is stood in for by a function that writes those rows and returns what
rlrun.tools.bench.logged.run_logged_session returns."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import verl_grpo  # noqa: E402

from rlrun.tools.bench.step import WARMUP_STEPS, StepSettings  # noqa: E402

SETTINGS = StepSettings(shape="tiny", prompts=2, samples=4, prompt_len=8, new_tokens=6, steps=5)


def row(step: int, step_s: float) -> dict:
    return {
        "step": step,
        "data": {
            "timing_s/step": step_s,
            "timing_s/gen": step_s / 4,
            "timing_s/update_actor": step_s / 2,
            "response_length/mean": 6.0,
        },
    }


def test_medians_leave_out_the_warm_up_steps():
    seconds = [80.0, 30.0, 10.0, 12.0, 11.0]
    summary = verl_grpo.summarise(SETTINGS, [row(i + 1, s) for i, s in enumerate(seconds)])
    assert summary["warmup_steps"] == WARMUP_STEPS == 2
    assert summary["median_step_s"] == 11.0
    assert summary["median_phases_s"] == {"gen": 2.75, "update_actor": 5.5}
    assert summary["fixed_length"] and "stopped_early" not in summary


def test_a_short_run_is_refused_unless_it_stopped_early():
    rows = [row(i + 1, s) for i, s in enumerate([80.0, 30.0, 10.0, 12.0])]
    with pytest.raises(RuntimeError, match="logged 4 steps but the run was set to 5"):
        verl_grpo.summarise(SETTINGS, rows)
    summary = verl_grpo.summarise(SETTINGS, rows, stopped="timeout after 480 s")
    assert summary["median_step_s"] == 11.0  # steps 3 and 4
    assert summary["stopped_early"] == "timeout after 480 s: 4 of 5 steps"


@pytest.mark.parametrize(("steps_logged", "kept"), [(4, True), (WARMUP_STEPS, False), (0, False)])
def test_a_run_that_times_out_keeps_its_steps_only_past_the_warm_up(tmp_path, monkeypatch, steps_logged, kept):
    def verl_stopped_by_its_limit(cmd, log, timeout_s, env, cwd):
        log.write_text("verl's output\n")
        if steps_logged:
            lines = [json.dumps(row(i + 1, 10.0)) for i in range(steps_logged)]
            Path(env["VERL_FILE_LOGGER_PATH"]).write_text("\n".join(lines) + "\n")
        return "timeout"

    monkeypatch.setattr(verl_grpo, "run_logged_session", verl_stopped_by_its_limit)
    if not kept:
        with pytest.raises(RuntimeError, match="ended with timeout"):
            verl_grpo.run_verl([], tmp_path, 480.0, 0.1)
        return
    metrics, stopped = verl_grpo.run_verl([], tmp_path, 480.0, 0.1)
    assert stopped == "timeout after 480 s"
    assert [r["step"] for r in verl_grpo.logged_rows(metrics)] == [1, 2, 3, 4]


def test_the_replay_poll_interval_reaches_verl_under_the_name_its_plugin_reads(tmp_path, monkeypatch):
    plugins = ast.parse((Path(verl_grpo.__file__).parent / "verl_plugins.py").read_text())
    assigned = {node.targets[0].id: node.value for node in plugins.body if isinstance(node, ast.Assign)}
    envs = []

    def verl_finishing(cmd, log, timeout_s, env, cwd):
        envs.append(env)
        Path(env["VERL_FILE_LOGGER_PATH"]).write_text(json.dumps(row(1, 10.0)) + "\n")
        return 0

    monkeypatch.setattr(verl_grpo, "run_logged_session", verl_finishing)
    verl_grpo.run_verl([], tmp_path, 480.0, 0.25)
    assert ast.literal_eval(assigned["REPLAY_POLL_ENV"]) == verl_grpo.REPLAY_POLL_ENV
    assert envs[0][verl_grpo.REPLAY_POLL_ENV] == "0.25"
