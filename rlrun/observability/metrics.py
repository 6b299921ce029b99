"""Step metrics: phase timing, and where rank 0 sends them (metrics.jsonl, console, TensorBoard, W&B).

Every logged name is defined in docs/metrics.md (the one glossary; a test checks it is complete).

``metrics.jsonl`` is the record of truth (one JSON object per step, ``step`` 0-based); on resume
the records of steps that are about to run again are dropped, so the file never holds a step twice.
``rlrun plot RUN_DIR`` draws it (rlrun/observability/plot.py).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Protocol

from torch.profiler import record_function

from rlrun.config.schema import RunConfig
from rlrun.observability.step_times import STEP_SECONDS, WALL_STEP_SECONDS

if TYPE_CHECKING:
    from rlrun.data.sample import Sample


class PhaseListener(Protocol):
    def phase_started(self, phase: str) -> None: ...


class PhaseTimer:
    """Wall time per named phase of one step: ``with timer("rollout"): ...``; each phase's start is told to the
    listeners (rank 0's progress bar, the watchdog's messages)."""

    def __init__(self, *listeners: PhaseListener | None) -> None:
        self.seconds: dict[str, float] = {}
        self.listeners = [listener for listener in listeners if listener is not None]

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        for listener in self.listeners:
            listener.phase_started(phase)
        start = time.perf_counter()
        try:
            with record_function(phase):  # a named range in profiler traces (rlrun/observability/profiler.py)
                yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{phase}_s": round(s, 4) for phase, s in self.seconds.items()}
        out[STEP_SECONDS] = round(sum(self.seconds.values()), 4)
        return out


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """``RUN_DIR/metrics.jsonl``: one JSON object per step."""

    def __init__(self, path: Path, start_step: int) -> None:
        self.path = path
        kept = []
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] < start_step]
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        """Nothing held open: every write appends and closes."""


class TensorBoardSink:
    """``RUN_DIR/tensorboard`` event files; on resume, events at or after the start step are purged."""

    def __init__(self, log_dir: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ValueError(
                "logging.tensorboard (true) needs the tensorboard package because torch writes its "
                "event files with it; pip install 'rlrun[logging]' or set logging.tensorboard=false"
            ) from exc
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step or None)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run whose id is kept in ``RUN_DIR/wandb_id``, so a resumed run continues it."""

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError(
                f"logging.wandb_project ('{project}') needs the wandb package; pip install wandb or "
                "set logging.wandb_project=null"
            ) from exc
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else wandb.util.generate_id()
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir), config=config
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class ConsoleProgress:
    """A live bar naming the current step and phase (in a terminal only) above one summary line per step."""

    def __init__(self, total_steps: int, start_step: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.total_steps = total_steps
        console = Console()
        self.progress = None
        if console.is_terminal:
            self.progress = Progress(
                TextColumn("{task.description:<28}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.progress.add_task("starting", total=total_steps, completed=start_step)
            self.progress.start()

    def phase(self, step: int, phase: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=f"step {step + 1}/{self.total_steps}  {phase}")

    def step_done(self, step: int, line: str) -> None:
        if self.progress is None:
            print(line, flush=True)
            return
        self.progress.console.print(line, markup=False, highlight=False)
        self.progress.update(self.task, completed=step + 1)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class MetricsLogger:
    """Rank 0's metrics: every step's record goes to each sink; :meth:`start` opens them."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        self.total_steps = cfg.train.num_steps
        self.sinks: list[Sink] = []
        self.console: ConsoleProgress | None = None
        self.step = 0
        """The step in progress (for the phase display)."""
        self._last_record_at = time.perf_counter()

    def start(self, step: int) -> None:
        """Open the sinks for a run that starts (or resumes) at ``step``."""
        log = self.cfg.logging
        self.step = step
        self._last_record_at = time.perf_counter()
        self.sinks.append(JsonlSink(self.run_dir / "metrics.jsonl", step))
        if log.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard", step))
        if log.wandb_project:
            self.sinks.append(WandbSink(log.wandb_project, self.run_dir, self.cfg.model_dump(mode="json")))
        if log.console:
            self.console = ConsoleProgress(self.total_steps, step)

    def phase_started(self, phase: str) -> None:
        if self.console is not None:
            self.console.phase(self.step, phase)

    def log(self, step: int, metrics: dict[str, float], samples: list[Sample] | None = None) -> None:
        """Write the step's metrics to every sink and, with ``logging.log_samples``, the first of its ``samples``
        (rlrun/observability/samples.py)."""
        if samples and self.cfg.logging.log_samples:
            from rlrun.observability.samples import sample_rows, write_samples

            wandb_run = next((sink.run for sink in self.sinks if isinstance(sink, WandbSink)), None)
            write_samples(self.run_dir, sample_rows(step, samples[: self.cfg.logging.log_samples]), wandb_run)
        now = time.perf_counter()
        record = {k: float(v) for k, v in metrics.items()}
        record[WALL_STEP_SECONDS] = round(now - self._last_record_at, 4)
        self._last_record_at = now
        for sink in self.sinks:
            sink.write(step, record)
        if self.console is not None:
            self.console.step_done(step, self.summary(step, record))
        self.step = step + 1

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        if self.console is not None:
            self.console.close()

    def summary(self, step: int, m: dict[str, float]) -> str:
        def get(key: str, fmt: str) -> str:
            return format(m[key], fmt) if key in m else "-"

        return (
            f"step {step + 1}/{self.total_steps}  reward {get('rollout/reward_mean', '.3f')}"
            f"  len {get('rollout/response_len_mean', '.1f')}  loss {get('train/policy_loss', '+.4f')}"
            f"  clip {get('train/clip_frac', '.3f')}  gnorm {get('train/grad_norm', '.3f')}"
            f"  gap {get('train/logprob_gap', '.2e')}  {get('time/step_s', '.1f')}s"
            f" (rollout {get('time/rollout_s', '.1f')} train {get('time/train_s', '.1f')}"
            f" sync {get('time/sync_s', '.1f')})"
        )
