"""docs/metrics.md is the one glossary: every name a real CPU run writes to metrics.jsonl, and every
metric name spelled out in rlrun's source, is defined there."""

from __future__ import annotations

import ast
import fnmatch
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
    records = run_train(
        tiny_model_dirs["qwen3"],
        tmp_path / "run",
        "train.num_steps=2",
        "rollout.dynamic_filter=nonzero_std",
        "rollout.over_sampling_prompts=6",
        "eval.interval=1",
        "eval.datasets=[{name: add, path: 'configs/data/addition_train.jsonl@[:4]'}]",
        "eval.pass_k=[1,2]",
        "eval.samples_per_prompt=2",
        "algorithm.kl.loss_coef=0.01",
        "algorithm.tis.mode=clip",
    )
    keys = {key for record in records for key in record}
    assert {"train/kl_loss", "train/tis_mean", "eval/add/pass@2", "rollout/filter_drop_frac"} <= keys
    assert undocumented(keys) == []


@pytest.mark.slow
def test_partial_rollout_run_writes_documented_keys(tiny_model_dirs, tmp_path):
    """A CLI training run with partial rollout: it trains through the loop, and its streaming-round
    metrics are all in the glossary."""
    records = run_train(
        tiny_model_dirs["qwen3"],
        tmp_path / "run",
        "train.num_steps=3",
        "rollout.max_new_tokens=64",
        "rollout.stop_token_ids=[0,1,2,3,4,5,6,7]",
        "rollout.over_sampling_prompts=8",
        "rollout.partial_rollout=true",
        "rollout.partial_rollout_mask_offpolicy=true",
    )
    keys = {key for record in records for key in record}
    assert {"rollout/tokens_saved", "rollout/staleness_max", "rollout/carried_groups", "train/loss"} <= keys
    assert undocumented(keys) == []
    assert sum(r["rollout/carried_groups"] for r in records) > 0  # surplus groups travelled to later steps
