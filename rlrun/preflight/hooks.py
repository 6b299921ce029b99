"""Every user hook a config can name, in one table: its config key, the signature it must have, where it is
called, and the loader that imports and checks it (the same loader its caller uses at run time).

Preflight resolves every hook the config sets against this table, so a bad path fails in ``rlrun config
validate`` naming the key's file and line, before any process starts. The caller loads its hook again
where it runs (rank processes import user code themselves); the resolver is ``rlrun.runtime.hooks``. A new
hook is its config field, its loader beside its caller, and one row here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from rlrun.agents import runner as agents
from rlrun.algo import validate as algo_hooks
from rlrun.config.schema import RunConfig
from rlrun.data import source
from rlrun.rollout import filters, multiturn, rollout_fn, train_samples
from rlrun.rollout.rewards import RewardSpecError, load_reward_fn, post_process
from rlrun.rollout.rewards import load as reward_load
from rlrun.runtime.hooks import HookSpecError

Problem = tuple[str, str]
"""(dotted config key, message): the caller adds the file and line of the key."""


@dataclass(frozen=True)
class Hook:
    """One user hook: where the config names it and what it must be."""

    key: str
    """Dotted config key; ``*`` stands for any name of a mapping or index of a list (``rollout.rewards.*``)."""
    signature: str
    """What the function must accept and return (the loader's own statement of it)."""
    called: str
    """Where and when the run calls it."""
    load: Callable[[RunConfig, str], Any]
    """``load(cfg, spec)``: the function (raises a ``ValueError`` naming the key, path and signature)."""


def _reward(cfg: RunConfig, spec: str) -> Any:
    return load_reward_fn(spec, cfg.rollout.remote_reward)


def _algorithm(field: str) -> Callable[[RunConfig, str], Any]:
    return lambda cfg, spec: algo_hooks.load_algorithm_hook(cfg.algorithm, field)


HOOKS: tuple[Hook, ...] = (
    Hook(
        "rollout.reward",
        reward_load.SIGNATURE,
        "rank 0 scores each finished sample (rlrun/rollout/rewards/score.py)",
        _reward,
    ),
    Hook("rollout.rewards.*", reward_load.SIGNATURE, "as rollout.reward, for the prompts of that reward type", _reward),
    Hook(
        "eval.datasets.*.reward",
        reward_load.SIGNATURE,
        "scores that eval set's samples (rlrun/rollout/evaluate.py)",
        _reward,
    ),
    Hook(
        "rollout.generate_fn",
        multiturn.SIGNATURE,
        "once per trajectory on each rank's event loop (rlrun/rollout/multiturn.py)",
        lambda cfg, spec: multiturn.load_generate_fn(spec),
    ),
    Hook(
        "rollout.agent",
        agents.SIGNATURE,
        "once per prompt's sample against the run's OpenAI-compatible endpoint (rlrun/agents/runner.py)",
        lambda cfg, spec: agents.load_agent(spec),
    ),
    Hook(
        "rollout.reward_post_process",
        post_process.SIGNATURE,
        "on the scored samples of each step, before the advantages (rlrun/rollout/collect.py)",
        lambda cfg, spec: post_process.load_reward_post_process(spec),
    ),
    Hook(
        "rollout.rollout_fn",
        rollout_fn.SIGNATURE,
        "replaces each training round's generation (rlrun/rollout/collect.py)",
        lambda cfg, spec: rollout_fn.RolloutFn.load(spec),
    ),
    Hook(
        "rollout.sample_to_train",
        train_samples.SIGNATURE,
        "on rank 0, each sample -> the samples it trains as (rlrun/trainer/batch.py)",
        lambda cfg, spec: train_samples.SampleToTrain.load(spec),
    ),
    Hook(
        "rollout.dynamic_filter",
        filters.SIGNATURE,
        "on rank 0, each scored group: keep or drop (rlrun/rollout/filters.py)",
        lambda cfg, spec: filters.load_filter(spec),
    ),
    Hook(
        "data.sampler",
        source.SIGNATURE,
        "once on rank 0 at setup, builds the prompt source (rlrun/data/source.py)",
        lambda cfg, spec: source.load_source_factory(spec),
    ),
    Hook(
        "algorithm.custom_advantage",
        algo_hooks.CUSTOM_ADVANTAGE_SIGNATURE,
        "every micro-batch, instead of the estimator (rlrun/algo/rank_advantages.py)",
        _algorithm("custom_advantage"),
    ),
    Hook(
        "algorithm.custom_loss",
        algo_hooks.CUSTOM_LOSS_SIGNATURE,
        "every micro-batch with loss_type: custom (rlrun/algo/objective.py)",
        _algorithm("custom_loss"),
    ),
    Hook(
        "algorithm.rollout_data_postprocess",
        algo_hooks.POSTPROCESS_SIGNATURE,
        "on every rank after the advantages, before training (rlrun/trainer/actor.py)",
        _algorithm("rollout_data_postprocess"),
    ),
)
"""Every user hook; ``tests/unit/test_hooks_table.py`` checks each string field of the schema that names a
function has a row."""


def hook_problems(cfg: RunConfig) -> list[Problem]:
    """Resolve every hook ``cfg`` sets; one problem per hook that does not resolve."""
    problems = []
    for hook in HOOKS:
        for key, spec in set_values(cfg, hook.key):
            try:
                hook.load(cfg, spec)
            except (HookSpecError, RewardSpecError) as err:
                message = str(err)
                problems.append((key, message if message.startswith(key) else f"{key}: {message}"))
    return problems


def set_values(cfg: BaseModel, pattern: str) -> list[tuple[str, str]]:
    """The (dotted key, value) pairs of ``cfg`` that ``pattern`` names and that are set (not None or empty)."""
    return [(key, value) for key, value in _walk(cfg, pattern.split("."), "") if value]


def _walk(node: Any, parts: list[str], prefix: str) -> Iterator[tuple[str, Any]]:
    if not parts:
        yield prefix.rstrip("."), node
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for name, child in items:
            yield from _walk(child, rest, f"{prefix}{name}.")
    elif node is not None:
        yield from _walk(getattr(node, head), rest, f"{prefix}{head}.")
