"""A rollout function replacing the round's generation, through the real CLI: a real embedded engine worker
runs examples/hooks/rollout_fn.py (each group's first half with half the token budget, its second half with
all of it), the run's reward scores the groups and Megatron trains one step on CPU. What trained is exactly
the function's samples: every one as its own sequence with its group's score, nothing else."""

from __future__ import annotations

import pytest
import torch

from integration.test_train_loop import REPO, run_train
from integration.test_train_samples_run import sequences
from rlrun.rollout.debug_data import load_rollout

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE, MAX_NEW_TOKENS = 2, 4, 6


def test_the_rollout_functions_samples_are_what_trains(tiny_model_dirs, tmp_path):
    run_dir = tmp_path / "run"
    [record] = run_train(
        tiny_model_dirs["qwen2"],
        run_dir,
        "train.num_steps=1",
        f"rollout.prompts_per_step={GROUPS}",
        f"rollout.samples_per_prompt={GROUP_SIZE}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        "rollout.ignore_eos=true",  # every response runs to its budget, so the budgets show in the lengths
        f"rollout.rollout_fn={REPO / 'examples/hooks/rollout_fn.py'}:mixed_budgets",
        "algorithm.skip_tied_groups=false",
        "debug.save_rollout_data=true",
        "debug.save_train_data=true",
        nproc=1,
    )
    assert record["rollout/sampling_rounds"] == 1
    samples = load_rollout(run_dir / "debug", 0)
    lengths = [len(s.response_ids) for s in samples]
    half = GROUP_SIZE // 2
    assert lengths == ([MAX_NEW_TOKENS // 2] * half + [MAX_NEW_TOKENS] * half) * GROUPS
    assert all(s.reward_error is None for s in samples)
    # scored by rollout.reward (the digit share of the reply) after the function returned them
    assert [s.reward for s in samples] == [
        sum(c.isdigit() for c in s.response_text) / max(len(s.response_text), 1) for s in samples
    ]
    rewards = torch.tensor([s.reward for s in samples]).view(GROUPS, GROUP_SIZE)
    scores = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()

    trained = [seq for mb in torch.load(run_dir / "debug/train_000000_rank0.pt") for seq in sequences(mb)]
    assert len(trained) == GROUPS * GROUP_SIZE
    unmatched = list(trained)
    for s, score in zip(samples, scores.tolist(), strict=True):
        tokens = s.prompt.prompt_ids + s.response_ids
        matches = [t for t in unmatched if t[0][: len(tokens)] == tokens and sum(t[1]) == len(s.response_ids)]
        assert matches, f"prompt {s.group_index}'s sample of {len(s.response_ids)} tokens was not trained"
        _, mask, advantages = matches[0]
        unmatched.remove(matches[0])
        trained_adv = torch.tensor([a for a, m in zip(advantages, mask, strict=True) if m])
        torch.testing.assert_close(trained_adv, torch.full_like(trained_adv, score))
    assert not unmatched
