"""``rlrun plot``: which panels a run gets, real PNG files of the right size, the smoothing formula,
and a CLI path that never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlrun.observability.plot import PANELS, PlotError, moving_average, plot_run

REPO = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path, num_steps: int) -> None:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(num_steps):
        record = {
            "step": step,
            "rollout/reward_mean": step / num_steps,
            "rollout/response_len_mean": 10.0 + step,
            "train/approx_kl": 1e-3 * step,
            "train/kl_ref": 2e-3 * step,
            "train/clip_frac": 0.01,
            "train/logprob_gap": 1e-6 * (step + 1),
            "time/rollout_s": 1.0,
            "time/train_s": 2.0,
            "time/step_s": 3.0,
            "time/wall_step_s": 3.1,
        }
        if step % 2:  # a metric some steps do not log
            record["train/entropy"] = 1.0 / (step + 1)
        lines.append(json.dumps(record))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_writes_one_png_per_panel_with_data_and_an_overview(tmp_path):
    import matplotlib.image

    write_run(tmp_path / "run", 25)
    written = plot_run(tmp_path / "run")
    names = [p.name for p in written]
    assert names == [
        "reward.png",
        "response_length.png",
        "kl.png",
        "entropy.png",
        "clip_fraction.png",
        "logprob_gap.png",
        "step_time.png",
        "overview.png",
    ]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(written[0]).shape
    assert (width, height) == (7 * 110, 4 * 110)  # figsize x dpi
    assert matplotlib.image.imread(written[-1]).shape[0] > 3 * height  # 4 rows of panels


def test_panels_pick_metrics_by_pattern_and_leave_out_the_step_totals(tmp_path):
    write_run(tmp_path / "run", 3)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    by_name = {panel.name: panel.keys(records) for panel in PANELS}
    assert by_name["kl"] == ["train/approx_kl", "train/kl_ref"]
    assert by_name["step_time"] == ["time/rollout_s", "time/train_s"]
    assert by_name["entropy"] == ["train/entropy"]


def test_panel_without_data_is_skipped(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.5}) + "\n")
    assert [p.name for p in plot_run(run_dir, tmp_path / "out")] == ["reward.png", "overview.png"]
    assert (tmp_path / "out/reward.png").is_file()


def test_moving_average_matches_the_definition():
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    window = 3
    expected = [sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(values))]
    assert moving_average(values, window) == pytest.approx(expected)


def test_missing_or_empty_metrics_is_a_plot_error(tmp_path):
    with pytest.raises(PlotError, match="does not exist"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match="empty"):
        plot_run(tmp_path)


def test_cli_plot_does_not_import_torch(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/reward_mean": 0.5}) + "\n")
    code = (
        "import sys; from typer.testing import CliRunner; from rlrun.cli import app; "
        f"r = CliRunner().invoke(app, ['plot', {str(tmp_path / 'run')!r}]); "
        "print(r.exit_code, 'torch' in sys.modules); print(r.output)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "0 False", out
    assert str(tmp_path / "run/plots/overview.png") in out
