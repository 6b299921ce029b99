"""One trajectory, two training samples, through the real CLI: a real embedded engine worker runs
examples/hooks/judge_agent.py (an answer, then a check of it in a context of its own), Megatron trains one
step on CPU. The saved training data holds every part of every trajectory as its own sequence: its prompt
and response tokens, a loss mask over exactly its response, and its trajectory's group score."""

from __future__ import annotations

import pytest
import torch

from integration.test_train_loop import REPO, run_train
from rlrun.data.batch import sample_ids
from rlrun.rollout.debug_data import load_rollout

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 2, 4


def sequences(micro_batch) -> list[tuple[list[int], list[int], list[float]]]:
    """(tokens, loss mask over the predicted tokens, advantages) of every packed sequence (the row's last
    one followed by the row's padding, which its positions continue)."""
    tokens, mask, adv = micro_batch["tokens"][0], micro_batch["loss_mask"][0], micro_batch["advantages"][0]
    ids = sample_ids(micro_batch["position_ids"])[0]
    out = []
    for i in ids.unique().tolist():
        if i < 0:
            continue
        where = (ids == i).nonzero()[:, 0]
        start, end = where[0].item(), where[-1].item() + 2  # position t predicts token t + 1
        out.append((tokens[start:end].tolist(), mask[start : end - 1].tolist(), adv[start : end - 1].tolist()))
    return out


def test_every_part_of_a_trajectory_trains(tiny_model_dirs, tmp_path):
    run_dir = tmp_path / "run"
    [record] = run_train(
        tiny_model_dirs["qwen2"],
        run_dir,
        "train.num_steps=1",
        f"rollout.prompts_per_step={GROUPS}",
        f"rollout.samples_per_prompt={GROUP_SIZE}",
        f"rollout.generate_fn={REPO / 'examples/hooks/judge_agent.py'}:generate",
        "rollout.max_context_tokens=256",
        "algorithm.skip_tied_groups=false",
        "debug.save_rollout_data=true",
        "debug.save_train_data=true",
        nproc=1,
    )
    assert record["rollout/train_samples"] == 2 * GROUPS * GROUP_SIZE
    trajectories = load_rollout(run_dir / "debug", 0)
    assert len(trajectories) == GROUPS * GROUP_SIZE and all(len(t.parts) == 2 for t in trajectories)
    rewards = torch.tensor([t.reward for t in trajectories]).view(GROUPS, GROUP_SIZE)
    scores = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()

    trained = [seq for mb in torch.load(run_dir / "debug/train_000000_rank0.pt") for seq in sequences(mb)]
    assert len(trained) == 2 * GROUPS * GROUP_SIZE
    unmatched = list(trained)
    for t, score in zip(trajectories, scores.tolist(), strict=True):
        answer, check = t.parts
        assert check.prompt.prompt_ids != answer.prompt.prompt_ids  # the check is a context of its own
        for part in t.parts:
            tokens = part.prompt.prompt_ids + part.response_ids
            prompt_len = len(part.prompt.prompt_ids)
            matches = [s for s in unmatched if s[0][: len(tokens)] == tokens]
            assert matches, f"prompt {t.group_index}'s part of {len(part.response_ids)} tokens was not trained"
            _, mask, advantages = matches[0]
            unmatched.remove(matches[0])
            padding = len(mask) - (len(tokens) - 1)
            assert mask == [0.0] * (prompt_len - 1) + [1.0] * len(part.response_ids) + [0.0] * padding
            assert sum(mask) == part.num_loss_tokens
            trained_adv = [a for a, m in zip(advantages, mask, strict=True) if m]
            torch.testing.assert_close(torch.tensor(trained_adv), torch.full_like(torch.tensor(trained_adv), score))
    assert not unmatched
