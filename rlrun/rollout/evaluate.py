"""Evaluation every ``eval.interval`` steps on one or more datasets: mean reward and pass@k.

Each eval prompt gets ``eval.samples_per_prompt`` responses (same generation path as training:
engine or ``rollout.generate_fn``; same reward), spread over all ranks like a rollout. An eval set may
set its own group size, temperature, length, stop strings, reward and reward key
(``eval.datasets[i].*``, each falling back to ``eval.*``, then ``rollout.*``). A response
counts as solved when its reward is at least ``eval.success_threshold``. pass@k is the unbiased
estimator of Chen et al. 2021 (arXiv 2107.03374), averaged over prompts::

    pass@k = 1 - C(n - c, k) / C(n, k)     (n samples, c solved; 1 when n - c < k)

Logged as ``eval/<name>/*``, with dict-reward keys and data sources broken down as in training
(rlrun/rollout/rewards/breakdown.py; docs/metrics.md); the loop times it as its own phase, ``time/eval_s``.
"""

from __future__ import annotations

from math import comb

from rlrun.data.prompts import PromptDataset
from rlrun.data.sample import Prompt
from rlrun.data.transfer import gather_to_rank0, scatter_from_rank0
from rlrun.engine.group import EngineLost
from rlrun.rollout.driver import group_samples, split_groups
from rlrun.rollout.rewards.breakdown import reward_breakdown
from rlrun.rollout.rewards.select import RewardByType, load_rewards


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


class Evaluator:
    """Eval datasets (tokenized on rank 0 at setup) and the periodic eval itself."""

    def __init__(self, runtime, tokenizer):
        self.runtime = runtime
        self.cfg = runtime.cfg.eval
        self.source_key = runtime.cfg.data.source_key
        self.rollout_cfgs = {ds.name: self.cfg.rollout_for(runtime.cfg.rollout, ds) for ds in self.cfg.datasets}
        self.reward_fns = {  # a set without its own reward scores as training does (the run's resolved hook)
            ds.name: runtime.hooks.reward_fn if ds.reward is None else load_rewards(self.rollout_cfgs[ds.name])
            for ds in self.cfg.datasets
        }
        self.datasets: dict[str, list[Prompt]] = {}
        if runtime.parallel.is_rank0:
            for ds in self.cfg.datasets:
                self.datasets[ds.name] = PromptDataset(ds.data_config(runtime.cfg.data), tokenizer).prompts
                if isinstance(self.reward_fns[ds.name], RewardByType):
                    self.reward_fns[ds.name].check(self.datasets[ds.name], ds.path)

    def due(self, step: int) -> bool:
        """Every ``eval.interval`` steps from step 0 (from step ``interval`` without ``eval.before_train``)."""
        return self.cfg.interval > 0 and step % self.cfg.interval == 0 and (step > 0 or self.cfg.before_train)

    def run(self, step: int) -> dict[str, float]:
        """Every rank takes part; rank 0 returns the metrics, the others ``{}``."""
        metrics: dict[str, float] = {}
        parallel = self.runtime.parallel
        for index, ds in enumerate(self.cfg.datasets):
            plan = split_groups(self.datasets[ds.name], parallel.world_size) if parallel.is_rank0 else None
            prompts = scatter_from_rank0(plan, parallel.cpu_group)
            seed = self.runtime.cfg.train.seed * 7_919 + step * 31 + index * 131_071 + parallel.rank
            r = self.rollout_cfgs[ds.name]
            samples = self.runtime.generate_and_score(prompts, seed, r, self.reward_fns[ds.name])
            gathered = gather_to_rank0(samples, parallel.cpu_group)
            if gathered is not None:  # a lost engine's share is missing: the loop redoes the step (and this eval)
                scored = [s for part in gathered if not isinstance(part, EngineLost) for s in part]
                if scored:
                    metrics.update(self._metrics(ds.name, scored, r.samples_per_prompt))
        return metrics

    def _metrics(self, name: str, samples: list, n: int) -> dict[str, float]:
        groups = group_samples(samples, n)
        solved = [sum(s.reward >= self.cfg.success_threshold for s in g) for g in groups]
        out = {f"eval/{name}/reward_mean": sum(s.reward for s in samples) / len(samples)}
        out.update(reward_breakdown(samples, self.source_key, f"eval/{name}"))
        for k in self.cfg.pass_k:
            if k <= n:
                out[f"eval/{name}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(groups)
        return out
