"""What a finished run leaves, through the Python API in one process (no torchrun): a 3-step run that sets only
model, data and reward exports ``RUN_DIR/model``, which ``transformers`` loads and whose fp32 log-probs equal the
trainer's; the same run directory with another model refuses to resume, naming both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
REWARD = f"{REPO / 'tests/fixtures/rewards.py'}:digit_fraction"


def train(config: Path, **overrides) -> subprocess.CompletedProcess:
    """``rlrun.train(config, **overrides)`` in a fresh plain-python process (world size 1)."""
    code = f"import rlrun; rlrun.train({str(config)!r}, **{overrides!r})"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def hf_logprobs(model, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Next-token log-probs of a packed row, one HF forward per sample (a sample starts where positions are 0)."""
    starts = (positions == 0).nonzero().flatten().tolist() + [len(tokens)]
    out = torch.zeros(len(tokens) - 1)
    for begin, end in zip(starts[:-1], starts[1:], strict=True):
        with torch.no_grad():
            logits = model(tokens[begin:end].unsqueeze(0)).logits[0].float()
        picked = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[begin + 1 : end, None]).squeeze(-1)
        out[begin : end - 1] = picked
    return out


def test_finished_run_exports_a_loadable_model_and_refuses_another_model(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    config = tmp_path / "mini.yaml"
    config.write_text(
        f"model:\n  path: {tiny_model_dirs['qwen3']}\ndata:\n  path: {REPO / 'configs/data/addition_train.jsonl'}\n"
        f"rollout:\n  reward: {REWARD}\n"
    )
    run_dir = tmp_path / "run"
    first = train(config, train={"num_steps": 3}, logging={"run_dir": str(run_dir)})
    assert first.returncode == 0, first.stderr[-4000:]
    assert f"{run_dir / 'model'}" in first.stdout  # said at start where the model goes
    assert (run_dir / "checkpoints" / "step_000003" / "COMPLETE").is_file()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.float32).eval()

    # The trainer's log-probs of the exported weights: one more step resumed from step_000003, its batch saved;
    # two updates per rollout, so the old-policy forward runs (one update reuses the training forward's instead).
    more = {"train.num_steps": 4, "train.updates_per_rollout": 2, "logging.run_dir": str(run_dir)}
    more["debug.save_train_data"] = True
    second = train(config, **more, checkpoint={"export_at_end": False})
    assert second.returncode == 0, second.stderr[-4000:]
    rows = torch.load(run_dir / "debug" / "train_000003_rank0.pt", weights_only=True)
    gaps = []
    for row in rows:
        mask = row["loss_mask"] > 0
        for tokens, positions, old, m in zip(
            row["tokens"], row["position_ids"], row["old_logprobs"], mask, strict=True
        ):
            gaps.append((hf_logprobs(model, tokens, positions)[m] - old[m]).abs().max().item())
    assert gaps and max(gaps) < 1e-5, gaps

    other = train(config, model={"path": str(tiny_model_dirs["llama"])}, logging={"run_dir": str(run_dir)})
    assert other.returncode != 0
    refusal = other.stderr.strip().splitlines()[-1]
    assert str(tiny_model_dirs["llama"]) in refusal and str(tiny_model_dirs["qwen3"]) in refusal, refusal
    assert "logging.run_dir" in refusal, refusal
