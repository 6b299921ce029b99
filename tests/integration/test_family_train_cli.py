"""``rlrun train`` per model family through the real CLI (torchrun, 2 ranks, the embedded engine):
Mistral (explicit head_dim) at TP=2 (3 key/value groups padded to 4), GLM-4.5 MoE and DeepSeek-V3 at DP=2 with
rollout routing replay (configs/quickstart_moe.yaml, a second step after the first sync: the engine records
routing, the trainer replays it; the config's own Qwen3-MoE is checked against HF in test_moe_parity.py and
test_moe_train.py). The engine (transformers) and the trainer (Megatron) score the sampled tokens alike:
``train/logprob_gap`` < 1e-4 in fp32 at step 0, < 1e-3 for the MoE step after a sync. The other dense
``FAMILY_KINDS`` (RoPE scaling) go through the same CLI code; tests/integration/test_megatron_hf_parity.py
checks each of them at TP=2 against transformers (log-probs, the export the weight sync sends, one finite
training step) without a process launch each."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MOE_KINDS = ("glm4_moe", "deepseek_v3")


@pytest.mark.parametrize("kind", ["mistral", *MOE_KINDS])
def test_one_training_step_matches_the_engine(kind, tmp_path):
    model_dir = make_tiny_model(kind, tmp_path / kind, seed=2)
    run_dir = tmp_path / "run"
    config = "quickstart_moe.yaml" if kind in MOE_KINDS else "quickstart.yaml"
    steps = 2 if kind in MOE_KINDS else 1
    overrides = [f"model.path={model_dir}", f"logging.run_dir={run_dir}", f"train.num_steps={steps}"]
    if kind not in MOE_KINDS:
        overrides += [
            "parallel.tp=2",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4",
            "algorithm.skip_tied_groups=false",
        ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "rlrun"]
    cmd += ["train", str(REPO / "configs" / config)]
    for override in overrides:
        cmd += ["--set", override]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps))
    for record in records:
        assert math.isfinite(record["train/loss"]) and math.isfinite(record["train/grad_norm"]), record
        assert record["train/logprob_gap"] < 1e-3, record  # MoE: the engine's routing replayed after the sync
    assert records[0]["train/logprob_gap"] < 1e-4, records[0]
