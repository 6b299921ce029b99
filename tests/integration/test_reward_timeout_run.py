"""A reward that sleeps forever on some samples, through the real CLI under torchrun (tiny model): with
``rollout.reward_timeout_s`` every step finishes, the hung samples score 0 and each is counted in
``rollout/reward_errors`` (metrics.jsonl)."""

from __future__ import annotations

import textwrap

import pytest
from test_rollout_cli import records, torchrun

pytestmark = pytest.mark.slow
HANGS = textwrap.dedent("""
    import time

    def hang_on_first_prompt(sample):
        if sample.prompt.index == 0:
            time.sleep(10**6)  # a verifier that never answers
        return 1.0 if sample.response_text.strip() else 0.5
""")


def test_hung_samples_score_zero_and_every_step_finishes(tiny_model_dirs, tmp_path):
    reward = tmp_path / "hangs.py"
    reward.write_text(HANGS)
    run_dir = tmp_path / "run"
    torchrun(
        "configs/quickstart.yaml",
        tiny_model_dirs["qwen2"],
        run_dir,
        "data.path=configs/data/addition_train.jsonl@[:2]",  # both rows every step: row 0's 4 samples hang
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        f"rollout.reward={reward}:hang_on_first_prompt",
        "rollout.reward_timeout_s=2",
        "rollout.reward_processes=4",
        "algorithm.max_logprob_gap=null",
        "train.num_steps=3",
    )
    steps = records(run_dir)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["rollout/reward_errors"] == 4 for r in steps), [r["rollout/reward_errors"] for r in steps]
    assert all(r["rollout/raw_reward_mean"] <= 0.5 + 1e-9 for r in steps)  # 4 zeros, 4 rewards of at most 1.0
