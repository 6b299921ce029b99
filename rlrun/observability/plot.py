"""``rlrun plot RUN_DIR``: PNG curves of a run from its ``metrics.jsonl``.

Writes ``RUN_DIR/plots/<panel>.png`` for every panel that has data, and ``overview.png`` with all
of them on one page. A panel draws each metric matching its patterns (so metrics added later, such
as ``train/kl_ref``, join the right panel); noisy curves get a moving average on top of the raw
values. Needs matplotlib (``pip install 'rlrun[plot]'``); runs without torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from rlrun.observability.step_times import STEP_TOTALS

SMOOTH_MIN_POINTS = 10


@dataclass(frozen=True)
class Panel:
    name: str
    """File stem of the panel's PNG."""
    title: str
    patterns: tuple[str, ...]
    """fnmatch patterns of the metric names drawn."""
    ylabel: str = ""
    stacked: bool = False
    """Stack the curves (parts of a whole, like the phases of a step)."""
    log_y: bool = False

    def keys(self, records: list[dict]) -> list[str]:
        names = sorted({k for r in records for k in r if k != "step"})
        return [k for k in names if any(fnmatch(k, p) for p in self.patterns) and k not in STEP_TOTALS]


PANELS = (
    Panel("reward", "Reward", ("rollout/reward_mean", "rollout/raw_reward_mean", "eval/*reward*")),
    Panel("response_length", "Response length", ("rollout/response_len_mean",), ylabel="tokens"),
    Panel("kl", "KL estimates", ("*kl*", "train/mismatch_k*")),
    Panel("entropy", "Entropy", ("*entropy*",), ylabel="nats"),
    Panel("clip_fraction", "Clipped token fraction", ("*clip_frac*",)),
    Panel("logprob_gap", "|trainer - engine| log-prob gap", ("train/logprob_gap",), log_y=True),
    Panel("step_time", "Step time by phase", ("time/*_s",), ylabel="seconds", stacked=True),
)


class PlotError(ValueError):
    """The run directory has nothing to plot, or matplotlib is missing."""


def load_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        raise PlotError(f"{path} does not exist; pass the logging.run_dir of a run that has logged at least one step")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise PlotError(f"{path} is empty; the run has not finished a step yet")
    return records


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per panel with data, plus ``overview.png``; returns the paths written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError("rlrun plot needs matplotlib; pip install 'rlrun[plot]'") from exc
    records = load_metrics(Path(run_dir) / "metrics.jsonl")
    out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = [(panel, keys) for panel in PANELS if (keys := panel.keys(records))]
    written = []
    for panel, keys in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        draw(ax, panel, keys, records)
        written.append(_save(fig, out_dir / f"{panel.name}.png"))
    num_cols = 2
    num_rows = math.ceil(len(panels) / num_cols)
    fig, axes = plt.subplots(num_rows, num_cols, figsize=(7 * num_cols, 3.6 * num_rows), squeeze=False)
    for ax, (panel, keys) in zip(axes.flat, panels, strict=False):
        draw(ax, panel, keys, records)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"{Path(run_dir).resolve().name}: {len(records)} steps")
    written.append(_save(fig, out_dir / "overview.png"))
    return written


def draw(ax, panel: Panel, keys: list[str], records: list[dict]) -> None:
    """One panel on ``ax``: each metric against the step, where the step logged it."""
    if panel.stacked:
        steps = [r["step"] for r in records]
        ax.stackplot(
            steps,
            [[r.get(k, 0.0) for r in records] for k in keys],
            labels=[k.removeprefix("time/").removesuffix("_s") for k in keys],
            alpha=0.85,
        )
    else:
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            steps, values = [p[0] for p in points], [p[1] for p in points]
            smooth = len(values) >= SMOOTH_MIN_POINTS
            (line,) = ax.plot(
                steps, values, alpha=0.3 if smooth else 1.0, label=None if smooth else key, marker="" if smooth else "."
            )
            if smooth:  # the legend shows the smoothed line; the faint one under it is the raw values
                ax.plot(steps, moving_average(values, max(2, len(values) // 10)), color=line.get_color(), label=key)
        if panel.log_y and all(r[k] > 0 for r in records for k in keys if k in r):
            ax.set_yscale("log")
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
