"""A user function that replaces a sampling round's generation (slime's ``--rollout-function-path``)::

    def fn(ctx: RolloutContext) -> list[list[Sample]]     # rollout.rollout_fn: one group per ctx.prompts[i]

slime's rollout function gets the run's args, the rollout id and the data source, and returns the step's
groups. rlrun's ranks each drive their own engine and only rank 0 holds the data, so the function runs on
every rank (on an engine group's leader for the whole group, ``engine.tp`` > 1), once per sampling round,
with the round's prompts of that rank, already drawn by rank 0's sampler (a custom data source is
``data.sampler``). It may call the engine as it likes (``ctx.engine``: the engine contract's ``generate``,
docs/engine-contract.md) or through ``ctx.generate`` (rlrun's own generation, a ``generate_fn`` included,
with changed ``rollout.*`` settings). What it returns then goes the normal way: scored with
``rollout.reward`` (unless ``rollout.rollout_fn_scores``: the function set ``sample.reward``, as slime's
do), the OPD teacher, the dynamic filter and its refill rounds, the group scores, training.

The returned groups must follow the samples' invariants the rest relies on: one group of
``samples_per_prompt`` samples per prompt, in the prompts' order, each sample answering its prompt
(``group_index == prompt.index``; a group's samples share its ``prompt_ids``, which the function may
have changed) with one log-prob per response token. Evaluation generates as usual (slime's
``--eval-function-path`` has no rlrun form). Example: examples/hooks/rollout_fn.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from rlrun.config.schema import RolloutConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.rewards.score import is_finite_reward
from rlrun.runtime.hooks import load_hook

SIGNATURE = "fn(ctx: RolloutContext) -> list[list[Sample]]"


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout function gets for one sampling round on one rank."""

    step: int
    round_index: int
    """0 for the step's first round; more come while the dynamic filter keeps too few groups."""
    prompts: list[Prompt]
    """This rank's prompts of the round (whole groups: return one group per prompt)."""
    seed: int
    """The round's sampling seed on this rank (what rlrun's own generation would use)."""
    config: RolloutConfig
    engine: Any
    """This rank's ``EngineClient`` (``engine.generate(input_ids, sampling_params, return_logprob=True)``)."""
    tokenizer: Any
    generate_samples: Callable[[list[Prompt], RolloutConfig, int], list[Sample]]

    def generate(
        self, prompts: list[Prompt], config: RolloutConfig | None = None, seed: int | None = None
    ) -> list[Sample]:
        """rlrun's generation of ``config.samples_per_prompt`` samples per prompt, prompt-major (an engine
        call, or ``rollout.generate_fn``), unscored; ``config`` defaults to the run's ``rollout``
        (``ctx.config.model_copy(update={...})`` changes settings), ``seed`` to the round's."""
        return self.generate_samples(prompts, config or self.config, self.seed if seed is None else seed)


@dataclass(frozen=True)
class RolloutFn:
    """``rollout.rollout_fn``'s function and the spec it was loaded from (named in its errors)."""

    fn: Callable[[RolloutContext], list[list[Sample]]]
    spec: str

    @classmethod
    def load(cls, spec: str) -> RolloutFn:
        return cls(load_hook(spec, "rollout.rollout_fn", SIGNATURE, num_args=1), spec)

    def run(self, ctx: RolloutContext, scored: bool) -> list[Sample]:
        """Call the function and return its samples, prompt-major, checked against the invariants above
        (``scored``: also that every reward is a finite float)."""
        groups = self.fn(ctx)
        n = ctx.config.samples_per_prompt
        if not isinstance(groups, list) or len(groups) != len(ctx.prompts):
            got = f"{len(groups)} groups" if isinstance(groups, list) else type(groups).__name__
            self._fail(ctx, f"returned {got} for {len(ctx.prompts)} prompts", "one group per prompt, in order")
        for prompt, group in zip(ctx.prompts, groups, strict=True):
            if not isinstance(group, list) or len(group) != n or not all(isinstance(s, Sample) for s in group):
                self._fail(ctx, f"returned {group!r:.80} for prompt {prompt.index}", f"a list of {n} Sample")
            for s in group:
                self._check_sample(ctx, prompt, s, scored)
            if any(s.prompt.prompt_ids != group[0].prompt.prompt_ids for s in group):
                self._fail(ctx, f"gave prompt {prompt.index}'s samples different prompt_ids", "groups of one prompt")
        return [s for group in groups for s in group]

    def _check_sample(self, ctx: RolloutContext, prompt: Prompt, s: Sample, scored: bool) -> None:
        if s.group_index != prompt.index or s.prompt.index != prompt.index:
            self._fail(
                ctx,
                f"put a sample of prompt {s.group_index} in prompt {prompt.index}'s group",
                "samples answering their group's prompt (group_index == prompt.index)",
            )
        if len(s.rollout_logprobs) != len(s.response_ids):
            self._fail(
                ctx,
                f"returned a sample of prompt {prompt.index} with {len(s.rollout_logprobs)} log-probs for "
                f"{len(s.response_ids)} response tokens",
                "one rollout log-prob per response token",
            )
        if scored and not is_finite_reward(s.reward):
            self._fail(ctx, f"set reward {s.reward!r} on prompt {prompt.index}", "a finite float sample.reward")

    def _fail(self, ctx: RolloutContext, what: str, expected: str) -> NoReturn:
        raise ValueError(
            f"rollout.rollout_fn ('{self.spec}') {what} at step {ctx.step}, round {ctx.round_index}; it must "
            f"return {expected} (signature {SIGNATURE}) because the groups go on to the reward, the filter and "
            "the group scores as rlrun's own would; fix the hook"
        )
