"""pass@k against brute-force enumeration, eval/debug config checks, dynamic-filter loading, and the
rollout data files round-tripping every sample field."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from minimal_config import data_config, run_config
from rlrun.config.schema import EvalConfig
from rlrun.data.batch import collate
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.debug_data import load_rollout, save_rollout, save_train_data
from rlrun.rollout.evaluate import pass_at_k
from rlrun.rollout.filters import apply_filter, load_filter, nonzero_std
from rlrun.runtime.hooks import HookSpecError


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (5, 2), (6, 6)])
def test_pass_at_k_matches_enumeration(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_eval_and_debug_config_checks():
    with pytest.raises(ValueError, match=r"eval.interval \(5\) must be 0 when eval.datasets is empty"):
        EvalConfig(interval=5)
    with pytest.raises(ValueError, match=r"names \(\['a', 'a'\]\) must be unique"):
        EvalConfig(datasets=[{"name": "a", "path": "x"}, {"name": "a", "path": "y"}])
    with pytest.raises(ValueError, match="debug.rollout_only .* must be false when debug.load_rollout_data is set"):
        run_config({"debug": {"rollout_only": True, "load_rollout_data": "d"}})
    with pytest.raises(
        ValueError, match=r"rollout.over_sampling_prompts \(2\) must be >= rollout.prompts_per_step \(4\)"
    ):
        run_config({"rollout": {"prompts_per_step": 4, "over_sampling_prompts": 2}})
    ds = EvalConfig(datasets=[{"name": "a", "path": "e.jsonl@[:5]", "prompt_key": "question"}]).datasets[0]
    data = ds.data_config(data_config(system_prompt="S", label_key="answer"))
    assert (data.path, data.prompt_key, data.label_key, data.system_prompt, data.shuffle) == (
        "e.jsonl@[:5]",
        "question",
        "answer",
        "S",
        False,
    )


def group(*rewards):
    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="")
    return [
        Sample(
            group_index=0,
            prompt=prompt,
            response_ids=[2],
            response_text="",
            rollout_logprobs=[0.0],
            finish_reason="stop",
            reward=r,
        )
        for r in rewards
    ]


def test_filters(tmp_path):
    assert load_filter("nonzero_std") is nonzero_std
    groups = [group(1.0, 1.0), group(0.0, 1.0), group(0.5, 0.5, 0.5), group(0.0, 1e-9)]
    assert apply_filter(nonzero_std, groups) == [groups[1], groups[3]]
    hook = tmp_path / "f.py"
    hook.write_text("def keep(group):\n    return 1\n\ndef two(a, b):\n    return True\n")
    with pytest.raises(TypeError, match="rollout.dynamic_filter returned 1 for group 0; expected a bool"):
        apply_filter(load_filter(f"{hook}:keep"), groups)
    with pytest.raises(
        HookSpecError,
        match=r"rollout.dynamic_filter \('.*two'\) must be a built-in \(nonzero_std\) "
        r"or name a function with signature fn\(group: list\[Sample\]\) -> bool, but it takes",
    ):
        load_filter(f"{hook}:two")


def test_rollout_data_round_trips(tmp_path: Path):
    prompt = Prompt(
        index=3,
        prompt_ids=[5, 6],
        prompt_text="p",
        label={"answer": [1, 2]},
        metadata={"m": "x"},
        tools=[{"name": "calc"}],
    )
    samples = [
        Sample(
            group_index=3,
            prompt=prompt,
            response_ids=[7, 8, 9],
            response_text="r",
            rollout_logprobs=[-0.5, 0.0, -1.25],
            finish_reason="length",
            weight_version="4",
            reward=0.75,
            reward_error="ValueError: x",
            loss_mask=[1, 0, 1],
        ),
        Sample(
            group_index=3,
            prompt=prompt,
            response_ids=[1],
            response_text="s",
            rollout_logprobs=[-2.0],
            finish_reason="stop",
        ),
    ]
    save_rollout(tmp_path, 12, samples)
    assert load_rollout(tmp_path, 12) == samples
    with pytest.raises(FileNotFoundError, match=r"has no rollout_000013.jsonl for step 13"):
        load_rollout(tmp_path, 13)
    mb = collate(samples, [1.0, -1.0], pad_token_id=0)
    mb.old_logprobs = torch.randn_like(mb.loss_mask)
    rows = torch.load(save_train_data(tmp_path, 2, 1, [mb]))
    assert rows[0].keys() == {"tokens", "position_ids", "loss_mask", "advantages", "rollout_logprobs", "old_logprobs"}
    assert torch.equal(rows[0]["old_logprobs"], mb.old_logprobs) and torch.equal(rows[0]["loss_mask"], mb.loss_mask)


def test_rollout_hooks_load_from_the_config(tmp_path):
    from rlrun.config.load import load_config
    from rlrun.rollout.collect import RolloutHooks

    repo = Path(__file__).resolve().parents[2]
    hooks = RolloutHooks.load(load_config(repo / "configs/calculator_tool.yaml").rollout)
    assert hooks.reward_fn.__name__ == "reward" and hooks.generate_fn.__name__ == "generate"
    assert hooks.dynamic_filter is nonzero_std
    sync = tmp_path / "sync_gen.py"
    sync.write_text("def generate(traj):\n    return None\n")
    cfg = run_config({"rollout": {"generate_fn": f"{sync}:generate"}}).rollout
    with pytest.raises(
        HookSpecError,
        match=r"rollout.generate_fn \('.*'\) must be an async def with signature "
        r"async fn\(traj: Trajectory\) -> None",
    ):
        RolloutHooks.load(cfg)
