"""Step metrics: phase timing, the metrics.jsonl record, and the one-line console summary.

Glossary of logged names (README "Metrics" repeats it for users):
  rollout/reward_mean          mean reward over the step's samples
  rollout/reward_errors        samples whose reward function raised (scored 0)
  rollout/response_len_mean    mean response length in tokens
  rollout/truncated_frac       fraction of responses that hit max_new_tokens
  rollout/tied_group_frac      fraction of groups with identical rewards (no GRPO signal)
  train/policy_loss            token-mean PPO-clip loss
  train/clip_frac              fraction of response tokens where the clip was active
  train/approx_kl              token-mean old_logp - new_logp (k1) during the update
  train/grad_norm              global gradient norm before clipping
  train/logprob_gap            token-mean |trainer logp - engine logp| of the sampled tokens
  train/num_loss_tokens        response tokens that carried loss this step
  time/<phase>_s               wall seconds of each phase (rollout, logprobs, train, sync, ...)
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class PhaseTimer:
    """Wall time per named phase of one step: ``with timer("rollout"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{phase}_s": round(s, 4) for phase, s in self.seconds.items()}
        out["time/step_s"] = round(sum(self.seconds.values()), 4)
        return out


class MetricsLogger:
    """Appends one JSON object per step to ``RUN_DIR/metrics.jsonl`` and prints a summary line."""

    def __init__(self, run_dir: Path, console: bool, total_steps: int) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.console = console
        self.total_steps = total_steps
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.console:
            print(self.summary(step, metrics), flush=True)

    def summary(self, step: int, m: dict[str, float]) -> str:
        def get(key: str, fmt: str) -> str:
            return format(m[key], fmt) if key in m else "-"

        return (
            f"step {step + 1}/{self.total_steps}  reward {get('rollout/reward_mean', '.3f')}"
            f"  len {get('rollout/response_len_mean', '.1f')}  loss {get('train/policy_loss', '+.4f')}"
            f"  clip {get('train/clip_frac', '.3f')}  gnorm {get('train/grad_norm', '.3f')}"
            f"  gap {get('train/logprob_gap', '.2e')}  {get('time/step_s', '.1f')}s"
            f" (rollout {get('time/rollout_s', '.1f')} train {get('time/train_s', '.1f')} sync {get('time/sync_s', '.1f')})"
        )
