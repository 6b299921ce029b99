"""docs/metrics.md is the one glossary: every name a real CPU run writes to metrics.jsonl, and every
metric name spelled out in rlrun's source, is defined there."""

from __future__ import annotations

import ast
import fnmatch
import json
import re

import pytest

from integration.test_train_loop import REPO, run_train

GLOSSARY = REPO / "docs/metrics.md"
PREFIXES = ("rollout", "train", "eval", "time", "memory", "offload", "critic")
METRIC_NAME = re.compile(rf"^(?:{'|'.join(PREFIXES)})/[\w@/.]+$")


def documented() -> list[str]:
    """The glossary's names as fnmatch patterns (``<part>`` matches anything)."""
    names = re.findall(r"^\| `([^`]+)` \|", GLOSSARY.read_text(), flags=re.M)
    return [re.sub(r"<[^>]+>", "*", name) for name in names]


def undocumented(keys) -> list[str]:
    patterns = documented()
    return sorted(k for k in keys if not any(fnmatch.fnmatchcase(k, p) for p in patterns))


def test_every_metric_name_in_the_source_is_documented():
    literals = set()
    for path in (REPO / "rlrun").rglob("*.py"):
        tree = ast.parse(path.read_text())
        pieces = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        literals |= {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in pieces
            if METRIC_NAME.match(node.value)
        }
    assert len(literals) > 30  # the scan finds the names (rollout/*, train/*, offload/*, ...)
    assert undocumented(literals) == []
    assert undocumented(["train/not_a_metric"]) == ["train/not_a_metric"]


@pytest.mark.slow
def test_every_key_a_run_writes_is_documented(tiny_model_dirs, tmp_path):
    """Also the multi-task example's settings (configs/multi_task.yaml) through the CLI: two reward types
    picked by the rows' metadata, a dict reward, per-source metrics, per-eval-set settings, no eval before
    step 0."""
    rewards = "examples/multi_task/rewards.py"
    records = run_train(
        tiny_model_dirs["qwen3"],
        tmp_path / "run",
        "train.num_steps=2",
        "data.path=examples/multi_task/data/train.jsonl",
        "data.metadata_key=null",
        "rollout.generate_fn=examples/calculator_tool/agent.py:generate",
        f"rollout.rewards={{add: '{rewards}:addition', calc: '{rewards}:calculator'}}",
        "rollout.reward_key=correct",
        "rollout.dynamic_filter=nonzero_std",
        "rollout.over_sampling_prompts=6",
        "eval.interval=1",
        "eval.before_train=false",
        "eval.datasets=[{name: add, path: 'configs/data/addition_train.jsonl@[:4]', samples_per_prompt: 2}, "
        f"{{name: calc, path: 'examples/calculator_tool/data/eval.jsonl@[:2]', reward: '{rewards}:calculator'}}]",
        "eval.pass_k=[1,2]",
        "algorithm.kl.loss_coef=0.01",
        "algorithm.tis.mode=clip",
        nproc=1,  # the keys do not depend on the rank count; the partial-rollout run below has 2 ranks
    )
    keys = {key for record in records for key in record}
    assert {"train/kl_loss", "train/tis_mean", "eval/add/pass@2", "rollout/filter_drop_frac"} <= keys
    assert undocumented(keys) == []
    assert not any(k.startswith("eval/") for k in records[0]) and "eval/calc/reward/correct" in records[1]
    assert "eval/calc/pass@2" not in keys  # its group is eval.samples_per_prompt's 1
    per_source = {
        "rollout/source/addition/reward",
        "rollout/source/calculator/reward/tool_call",
        "rollout/reward/correct",
    }
    assert per_source <= keys


@pytest.mark.slow
def test_partial_rollout_run_writes_documented_keys_and_resumes_its_carry(tiny_model_dirs, tmp_path):
    """A CLI training run with partial rollout: it trains through the loop, its streaming-round metrics are
    all in the glossary, and the carry is checkpointed: stopped after 1 step and resumed for a second, every
    drawn group is trained exactly once or is in the last checkpoint's carry."""
    import torch

    run_dir = tmp_path / "run"
    settings = [
        "rollout.max_new_tokens=64",
        "rollout.stop_token_ids=[0,1,2,3,4,5,6,7]",
        "rollout.over_sampling_prompts=8",
        "rollout.partial_rollout=true",
        "rollout.partial_rollout_mask_offpolicy=true",
        "data.shuffle=false",  # the first `position` rows are the drawn ones
        "checkpoint.save_interval=1",
        "debug.save_rollout_data=true",
        "algorithm.max_logprob_gap=null",  # carried groups are off-policy by design (the config refuses the gate)
    ]
    run_train(tiny_model_dirs["qwen3"], run_dir, "train.num_steps=1", *settings)
    records = run_train(tiny_model_dirs["qwen3"], run_dir, "train.num_steps=2", *settings)
    assert [r["step"] for r in records] == [0, 1]  # the resumed run appended step 1
    keys = {key for record in records for key in record}
    assert {"rollout/tokens_saved", "rollout/staleness_max", "rollout/carried_groups", "train/loss"} <= keys
    assert undocumented(keys) == []
    assert sum(r["rollout/carried_groups"] for r in records) > 0  # surplus groups travelled to later steps

    def carried(step: int) -> set[int]:
        state = torch.load(run_dir / f"checkpoints/step_{step:06d}/rollout_carry.pt", weights_only=True)
        return {group[0]["group_index"] for group in state}

    trained = [
        row["group_index"]
        for step in range(2)
        for row in map(json.loads, (run_dir / f"debug/rollout_{step:06d}.jsonl").read_text().splitlines())
    ][::8]  # samples_per_prompt 8 (run_train)
    position = json.loads((run_dir / "checkpoints/step_000002/run_state.json").read_text())["sampler"]["position"]
    assert len(trained) == len(set(trained)) == 2 * 4  # quickstart: 4 groups per step, none twice
    assert set(trained) | carried(2) == set(range(position)) and not set(trained) & carried(2)
    # 8 groups drawn, 4 trained: step 1's checkpoint carried 4 (aborted or surplus); they came back
    assert len(carried(1)) == 4 and carried(1) <= set(trained) | carried(2)
