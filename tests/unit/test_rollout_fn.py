"""``rollout.rollout_fn``: the combinations refused at load, the checks on what the function returns, and
which of its samples the run's reward scores (the run through the real engine worker and trainer is
tests/integration/test_rollout_fn_run.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minimal_config import rollout_config, run_config, write_config
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rollout_fn import RolloutContext, RolloutFn

EXAMPLE = "examples/hooks/rollout_fn.py:mixed_budgets"


def test_refused_where_it_would_have_no_effect_or_conflict():
    with pytest.raises(ValueError, match=r"rollout.rollout_fn \('.*'\) must be unset with rollout.abort_surplus"):
        rollout_config(rollout_fn=EXAMPLE, partial_rollout=True)
    with pytest.raises(ValueError, match=r"rollout.rollout_fn_scores \(true\) must come with rollout.rollout_fn"):
        rollout_config(rollout_fn_scores=True)
    with pytest.raises(ValueError, match=r"must not come with rollout.reward_per_group \(True\)"):
        rollout_config(rollout_fn=EXAMPLE, rollout_fn_scores=True, reward_per_group=True)
    with pytest.raises(ValueError, match=r"must be unset with debug.load_rollout_data because the loaded"):
        run_config({"rollout": {"rollout_fn": EXAMPLE}, "debug": {"load_rollout_data": "/x"}})
    assert rollout_config(rollout_fn=EXAMPLE, rollout_fn_scores=True).rollout_fn_scores


def test_the_preflight_names_the_key_and_the_signature(tmp_path):
    from rlrun.config.load import ConfigError, read_config
    from rlrun.preflight import preflight

    path = write_config(tmp_path / "c.yaml", "rollout:\n  rollout_fn: examples/hooks/rollout_fn.py:missing\n")
    with pytest.raises(
        ConfigError,
        match=r"rollout.rollout_fn \('examples/hooks/rollout_fn.py:missing'\) must name a function with signature "
        r"fn\(ctx: RolloutContext\) -> list\[list\[Sample\]\], but 'examples/hooks/rollout_fn.py' has no attribute",
    ):
        preflight(read_config(path))


def prompts(num: int) -> list[Prompt]:
    return [Prompt(10 + i, [1, 2 + i], f"p{i}") for i in range(num)]


def answer(prompt: Prompt, tokens: list[int], reward: float = 0.0) -> Sample:
    return Sample(prompt.index, prompt, tokens, "", [-0.5] * len(tokens), "stop", reward=reward)


def context(ps: list[Prompt], n: int = 2) -> RolloutContext:
    return RolloutContext(3, 1, ps, 7, rollout_config(samples_per_prompt=n), None, None, lambda *a: [])


@pytest.mark.parametrize(
    "returned, message",
    [
        (lambda ps: [[answer(ps[0], [5]), answer(ps[0], [6])]], r"returned 1 groups for 2 prompts"),
        (lambda ps: "nope", r"returned str for 2 prompts"),
        (
            lambda ps: [[answer(p, [5])] for p in ps],
            r"returned \[Sample.* for prompt 10 at step 3, round 1; it must return a list of 2 Sample",
        ),
        (lambda ps: [[answer(ps[1], [5])] * 2, [answer(ps[1], [6])] * 2], r"put a sample of prompt 11 in prompt 10"),
        (
            lambda ps: [[answer(p, [5]), Sample(p.index, p, [5, 6], "", [0.0], "stop")] for p in ps],
            r"returned a sample of prompt 10 with 1 log-probs for 2 response tokens",
        ),
        (
            lambda ps: [[answer(p, [5]), answer(Prompt(p.index, [9], ""), [5])] for p in ps],
            r"gave prompt 10's samples different prompt_ids",
        ),
        (
            lambda ps: [[answer(p, [5], float("nan"))] * 2 for p in ps],
            r"set reward nan on prompt 10 .*it must return a finite float sample.reward",
        ),
        (
            lambda ps: [[answer(p, [5], True)] * 2 for p in ps],
            r"set reward True on prompt 10 .*it must return a finite float sample.reward",
        ),
    ],
)
def test_what_the_function_returns_is_checked(returned, message):
    hook = RolloutFn(lambda ctx: returned(ctx.prompts), "m:f")
    with pytest.raises(ValueError, match=rf"rollout.rollout_fn \('m:f'\) {message}"):
        hook.run(context(prompts(2)), scored=True)


def test_well_formed_groups_come_back_prompt_major():
    ps = prompts(2)
    groups = [[answer(p, [5], 1.0), answer(p, [6, 7], 0.0)] for p in ps]
    samples = RolloutFn(lambda ctx: groups, "m:f").run(context(ps), scored=True)
    assert samples == groups[0] + groups[1]


class Engine:
    """The engine contract's ``generate`` for one-token replies: token ``100 + prompt`` then ``+ i``."""

    def generate(self, input_ids, params, return_logprob=True):
        n = params["n"]
        return [
            {"output_ids": [100 + ids[-1] + i], "output_logprobs": [-1.0], "finish_reason": {"type": "stop"}}
            for ids in input_ids
            for i in range(n)
        ]


def runtime(tmp_path, **rollout):
    from rlrun.rollout.collect import RolloutHooks, RolloutRuntime

    (tmp_path / "hooks.py").write_text(
        "def reward(sample):\n"
        "    return float(sample.response_ids[0])\n"
        "def reversed_groups(ctx):\n"
        "    samples = ctx.generate(ctx.prompts)\n"
        "    n = ctx.config.samples_per_prompt\n"
        "    for s in samples:\n"
        "        s.reward = -1.0\n"
        "    return [samples[i * n : (i + 1) * n][::-1] for i in range(len(ctx.prompts))]\n"
    )
    r = {"samples_per_prompt": 2, "reward": f"{tmp_path}/hooks.py:reward", **rollout}
    cfg = run_config({"rollout": r})
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids))
    return RolloutRuntime(cfg, SimpleNamespace(), Engine(), tokenizer, None, RolloutHooks.load(cfg.rollout))


def test_training_rounds_use_the_function_and_the_run_scores_its_samples(tmp_path):
    rt = runtime(tmp_path, rollout_fn=f"{tmp_path}/hooks.py:reversed_groups")
    ps = prompts(2)
    samples = rt.generate_and_score(ps, seed=0, round_at=(0, 0))
    assert [s.response_ids for s in samples] == [[103], [102], [104], [103]]  # the function's order
    assert [s.reward for s in samples] == [103.0, 102.0, 104.0, 103.0]  # rollout.reward, not the hook's -1
    evaluated = rt.generate_and_score(ps, seed=0)  # no round_at: evaluation generates as rlrun does
    assert [s.response_ids for s in evaluated] == [[102], [103], [103], [104]]


def test_a_function_that_scores_keeps_its_rewards(tmp_path):
    rt = runtime(tmp_path, rollout_fn=f"{tmp_path}/hooks.py:reversed_groups", rollout_fn_scores=True)
    samples = rt.generate_and_score(prompts(2), seed=0, round_at=(0, 0))
    assert [s.reward for s in samples] == [-1.0] * 4
    assert rt.generate_and_score([], seed=0, round_at=(0, 0)) == []  # a rank without prompts calls nothing
