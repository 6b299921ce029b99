"""Rollout hooks by path: a data source (``data.sampler``) and a reward post-process
(``rollout.reward_post_process``), with the examples in examples/hooks/ checked against hand counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minimal_config import data_config, run_config, write_config
from rlrun.data.prompts import PromptSampler
from rlrun.data.sample import Prompt, Sample
from rlrun.data.source import build_source
from rlrun.rollout.debug_data import save_rollout
from rlrun.rollout.rewards.post_process import post_process_rewards


class Rows:
    """A tokenized dataset's surface (prompts, indexing, fingerprint)."""

    def __init__(self, sources: list[str]):
        self.prompts = [Prompt(i, [i], "", metadata={"source": s}) for i, s in enumerate(sources)]
        self.fingerprint = "f"

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, i):
        return self.prompts[i]


def test_data_sampler_round_robin_balances_sources_and_resumes_exactly():
    rows = Rows(["a"] * 6 + ["b"] * 2)
    assert isinstance(build_source(data_config(), rows, seed=0), PromptSampler)
    cfg = data_config(sampler="examples/hooks/sources.py:round_robin")
    source = build_source(cfg, rows, seed=3)
    first = source.next_batch(5)
    assert [p.metadata["source"] for p in first] == ["a", "b", "a", "b", "a"]
    state = source.state_dict()
    rest = [p.index for p in source.next_batch(7)]
    resumed = build_source(cfg, rows, seed=3)
    resumed.load_state_dict(state)
    assert [p.index for p in resumed.next_batch(7)] == rest
    assert sorted(p.index for p in first if p.metadata["source"] == "b") == [6, 7]  # a pass before a repeat

    bad = data_config(sampler="examples/hooks/rewards.py:length_penalty")  # 1 argument, not 3
    with pytest.raises(ValueError, match=r"data.sampler \('examples/hooks/rewards.py:length_penalty'\) must name"):
        build_source(bad, rows, seed=0)


def group(index: int, lengths: list[int], rewards: list[float]) -> list[Sample]:
    prompt = Prompt(index, [1], "")
    return [
        Sample(index, prompt, [2] * n, "", [0.0] * n, "stop", reward=r) for n, r in zip(lengths, rewards, strict=True)
    ]


def test_reward_post_process_length_penalty_and_refusals():
    from rlrun.runtime.hooks import resolve_hook

    length_penalty = resolve_hook("examples/hooks/rewards.py:length_penalty", num_args=1)
    samples = group(0, [2, 4, 6], [1.0, 1.0, 0.0]) + group(1, [3, 3], [0.5, 0.5])
    metrics = post_process_rewards(length_penalty, samples)
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.95, -0.1, 0.5, 0.5])
    assert metrics == {"rollout/reward_before_post_process": pytest.approx(3.0 / 5)}
    with pytest.raises(ValueError, match=r"returned list of 1 values; it must return a list of 5 floats"):
        post_process_rewards(lambda s: [0.0], samples)
    with pytest.raises(ValueError, match=r"returned nan for prompt 0"):
        post_process_rewards(lambda s: [float("nan")] * 5, samples)


def test_collect_applies_the_post_process_after_saving_raw_rewards(tmp_path):
    from rlrun.rollout.collect import RolloutHooks, RolloutRuntime

    save_rollout(tmp_path, 0, group(0, [2, 4], [1.0, 1.0]))
    cfg = run_config(
        {
            "rollout": {"reward_post_process": "examples/hooks/rewards.py:length_penalty"},
            "debug": {"load_rollout_data": str(tmp_path)},
        }
    )
    parallel = SimpleNamespace(is_rank0=True)
    runtime = RolloutRuntime(cfg, parallel, None, None, None, RolloutHooks.load(cfg.rollout))
    batch = runtime.collect(0)
    assert [s.reward for s in batch.samples] == pytest.approx([1.0, 0.9])
    assert batch.metrics["rollout/reward_before_post_process"] == 1.0


def test_the_preflight_resolves_the_hooks(tmp_path):
    """Hooks are resolved by the preflight (what ``config validate`` and ``train`` run), not by the loader."""
    from rlrun.config.load import ConfigError, load_config, read_config
    from rlrun.preflight import preflight

    path = tmp_path / "c.yaml"
    for key, text in (
        ("rollout.reward_post_process", "rollout:\n  reward_post_process"),
        ("data.sampler", "data:\n  sampler"),
    ):
        write_config(path, f"{text}: examples/hooks/rewards.py:missing\n")
        assert load_config(path)  # the loader describes the config only
        with pytest.raises(ConfigError, match=rf"{key} \('examples/hooks/rewards.py:missing'\) must name a function"):
            preflight(read_config(path))
