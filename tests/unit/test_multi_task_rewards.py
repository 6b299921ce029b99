"""Multi-task rewards: the row's metadata picks its reward, dict rewards train on ``rollout.reward_key``,
the step's rewards are broken down per key and per source (against hand counts), per-eval-set settings
fall back eval -> rollout, and ``eval.before_train``."""

from __future__ import annotations

import pytest

from minimal_config import rollout_config, write_config
from rlrun.config.schema import EvalConfig, EvalDatasetConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards import score_samples
from rlrun.rollout.rewards.breakdown import reward_breakdown
from rlrun.rollout.rewards.select import RewardByType, load_rewards

HOOKS = "examples/multi_task/rewards.py"


def sample(index: int, text: str, label, **metadata) -> Sample:
    prompt = Prompt(index=index, prompt_ids=[1], prompt_text="", label=label, metadata=metadata)
    return Sample(index, prompt, [2], text, [0.0], "stop")


def test_metadata_selects_the_reward_and_dict_rewards_train_on_reward_key():
    r = rollout_config(
        reward="exact_match",
        rewards={"add": f"{HOOKS}:addition", "calc": f"{HOOKS}:calculator"},
        reward_key="correct",
    )
    fn = load_rewards(r)
    samples = [
        sample(0, "7<|im_end|>", 7, reward_type="add", source="addition"),  # first_number on the last turn
        sample(
            1,
            "<calc>2*3</calc><|im_end|>\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n6",
            6,
            reward_type="calc",
            source="calculator",
        ),
        sample(2, "5", 6, reward_type="calc", source="calculator"),  # wrong, no tool call
        sample(3, "x", "x"),  # no type: rollout.reward (exact_match)
    ]
    assert score_samples(samples, fn, reward_key=r.reward_key) == 0
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 1.0]  # the turn marker is not a longer reply
    assert samples[1].reward_components == {"correct": 1.0, "tool_call": 1.0}
    assert samples[0].reward_components is None and samples[2].reward_components == {"correct": 0.0, "tool_call": 0.0}

    metrics = reward_breakdown(samples, "source", "rollout")
    assert metrics == {
        "rollout/reward/correct": 0.5,
        "rollout/reward/tool_call": 0.5,
        "rollout/source/addition/reward": 1.0,
        "rollout/source/calculator/reward": 0.5,
        "rollout/source/calculator/reward/correct": 0.5,
        "rollout/source/calculator/reward/tool_call": 0.5,
    }

    # Without reward_key (or with one the dict lacks) a dict reward fails its sample, counted and named.
    assert score_samples(samples[1:2], fn) == 1 and "set rollout.reward_key" in samples[1].reward_error
    assert score_samples(samples[1:2], fn, reward_key="nope") == 1 and "'nope'" in samples[1].reward_error
    assert samples[1].reward == 0.0 and samples[1].reward_components is None

    assert isinstance(fn, RewardByType)
    with pytest.raises(ValueError, match=r"data.jsonl row 9: metadata reward_type \('dapo'\) must name one of"):
        fn.check([sample(9, "", 1, reward_type="dapo").prompt], "data.jsonl")
    assert not isinstance(load_rewards(rollout_config()), RewardByType)  # no table: the plain reward


def test_eval_sets_fall_back_to_eval_then_rollout_settings_and_before_train():
    rollout = rollout_config(temperature=0.9, max_new_tokens=32, stop=["\n"], rewards={"calc": f"{HOOKS}:calculator"})
    own = EvalDatasetConfig(
        name="a", path="p", samples_per_prompt=3, temperature=0.5, stop=[], reward="exact_match", reward_key="k"
    )
    cfg = EvalConfig(interval=2, datasets=[own, EvalDatasetConfig(name="b", path="p")], max_new_tokens=16)
    a, b = (cfg.rollout_for(rollout, ds) for ds in cfg.datasets)
    assert (a.samples_per_prompt, a.temperature, a.max_new_tokens, a.stop, a.reward, a.rewards, a.reward_key) == (
        3,
        0.5,
        16,
        [],
        "exact_match",
        {},
        "k",
    )
    assert (b.samples_per_prompt, b.temperature, b.max_new_tokens, b.stop, b.reward, b.rewards) == (
        1,
        0.9,
        16,
        ["\n"],
        rollout.reward,
        rollout.rewards,
    )
    with pytest.raises(ValueError, match=r"eval.before_train \(false\) must be true when eval.interval is 0"):
        EvalConfig(before_train=False)


def test_eval_before_train_false_skips_only_step_0():
    from rlrun.rollout.evaluate import Evaluator

    def due(before_train: bool) -> list[int]:
        evaluator = Evaluator.__new__(Evaluator)  # due() reads only the eval config
        evaluator.cfg = EvalConfig(interval=2, before_train=before_train, datasets=[{"name": "a", "path": "p"}])
        return [step for step in range(6) if evaluator.due(step)]

    assert due(True) == [0, 2, 4] and due(False) == [2, 4]


def test_the_preflight_resolves_every_named_reward_and_eval_reward(tmp_path):
    from rlrun.config.load import ConfigError, load_config, read_config
    from rlrun.preflight import preflight

    path = write_config(tmp_path / "c.yaml", "rollout:\n  rewards:\n    calc: examples/multi_task/rewards.py:nope\n")
    with pytest.raises(ConfigError, match=r"rollout.rewards.calc: reward 'examples/multi_task/rewards.py:nope'"):
        preflight(read_config(path))
    write_config(path, "eval:\n  interval: 1\n  datasets: [{name: a, path: p, reward: 'no_such_builtin'}]\n")
    with pytest.raises(ConfigError, match=r"eval.datasets.0.reward: reward 'no_such_builtin'"):
        preflight(read_config(path))
    assert load_config("configs/multi_task.yaml").rollout.rewards["calc"].endswith("rewards.py:calculator")


def test_a_mapping_override_sets_the_reward_table():
    from rlrun.config.load import load_config

    cfg = load_config("configs/quickstart.yaml", [f"rollout.rewards={{calc: '{HOOKS}:calculator'}}"])
    assert cfg.rollout.rewards == {"calc": f"{HOOKS}:calculator"}
    text = load_config("configs/quickstart.yaml", ["logging.run_dir=a: b"]).logging.run_dir
    assert text == "a: b"  # "a: b" without braces stays text
