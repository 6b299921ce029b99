"""Dynamic sampling on 2 real ranks with real engines: the filter drops whole groups and rank 0 draws
more prompts until ``prompts_per_step`` groups pass (or the round limit is hit); the kept groups and
the sampler position are checked against the seeded draw order computed independently here."""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.slow

HOOKS = textwrap.dedent("""
    def reward(sample):
        # Multiples of 3 give tied groups; the others differ across samples (sums of random tokens).
        return 0.0 if sample.prompt.label % 3 == 0 else float(sum(sample.response_ids))

    def keep_even(group):
        return group[0].prompt.label % 2 == 0

    def keep_none(group):
        return False
""")
NUM_ROWS, SEED = 12, 7


def collect_scenarios(model_dir: str, run_dir: str, scenarios: list[tuple[dict, int]]):
    """On each rank: one engine; per scenario a fresh config, sampler and runtime, ``num_steps`` collects."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from minimal_config import run_config
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.engine.client import EngineClient
    from rlrun.engine.registry import BackendSpec
    from rlrun.rollout.collect import RolloutRuntime
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, SEED)
    results = []
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        with EngineClient.spawn(
            BackendSpec("embedded", str(model_dir), parallel.rank), run_dir=Path(run_dir), rank=parallel.rank
        ) as engine:
            for overrides, num_steps in scenarios:
                cfg = run_config({**overrides, "model": {"path": model_dir}, "train": {"seed": SEED}})
                sampler = PromptSampler(PromptDataset(cfg.data, tokenizer), seed=SEED) if parallel.is_rank0 else None
                runtime = RolloutRuntime.build(cfg, parallel, engine, tokenizer, sampler)
                batches = [runtime.collect(step) for step in range(num_steps)]
                if parallel.is_rank0:
                    results.append(
                        (
                            [([(s.prompt.label, s.reward) for s in b.samples], b.metrics) for b in batches],
                            sampler.state_dict(),
                        )
                    )
        dist.barrier(group=parallel.cpu_group)
        return results if parallel.is_rank0 else None
    finally:
        destroy_distributed()


def draw_order(num_draws: int) -> list[int]:
    """Labels in the order the sampler draws them: epoch e is random.Random(SEED + e).shuffle."""
    order = []
    for epoch in range(num_draws // NUM_ROWS + 1):
        perm = list(range(NUM_ROWS))
        random.Random(SEED + epoch).shuffle(perm)
        order += perm
    return order[:num_draws]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("filter")
    (root / "hooks.py").write_text(HOOKS)
    data = root / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "label": i}) + "\n" for i in range(NUM_ROWS)))
    return root, data


def rollout_cfg(root, data, **rollout):
    return {
        "data": {"path": str(data)},
        "rollout": {
            "prompts_per_step": 3,
            "samples_per_prompt": 4,
            "max_new_tokens": 4,
            "reward": f"{root}/hooks.py:reward",
            **rollout,
        },
    }


def test_filter_refills_and_limits(tiny_model_dirs, setup):
    root, data = setup
    refill = rollout_cfg(root, data, over_sampling_prompts=4, dynamic_filter="nonzero_std", max_sampling_rounds=10)
    even = rollout_cfg(root, data, dynamic_filter=f"{root}/hooks.py:keep_even", max_sampling_rounds=10)
    none = rollout_cfg(root, data, dynamic_filter=f"{root}/hooks.py:keep_none", max_sampling_rounds=2)
    results = run_distributed(
        collect_scenarios, 2, str(tiny_model_dirs["qwen2"]), str(root / "run"), [(refill, 2), (even, 1), (none, 1)]
    )
    check_refill(*results[0])
    [(samples, _)], _ = results[1]  # custom filter path: the first 3 even labels drawn, 3 per round
    evens = [label for label in draw_order(24) if label % 2 == 0][:3]
    assert [label for label, _ in samples] == [label for label in evens for _ in range(4)]
    [(samples, metrics)], state = results[2]
    # Limit hit with nothing kept: the last round's groups, unfiltered, and the exhaustion is reported.
    assert [label for label, _ in samples] == [label for label in draw_order(6)[3:6] for _ in range(4)]
    assert metrics["rollout/filter_exhausted"] == 1 and metrics["rollout/sampling_rounds"] == 2
    assert state["position"] == 6


def check_refill(steps, state):
    # Reference: walk the draw order in rounds of 4, keeping non-multiples of 3, until 3 are kept.
    drawn = 0
    for samples, metrics in steps:
        kept, rounds = [], 0
        while len(kept) < 3:
            kept += [label for label in draw_order(drawn + 4)[drawn:] if label % 3]
            drawn, rounds = drawn + 4, rounds + 1
        labels = [label for label, _ in samples]
        assert labels == [label for label in kept[:3] for _ in range(4)]  # whole groups, prompt-major
        assert metrics["rollout/sampling_rounds"] == rounds and metrics["rollout/prompts_drawn"] == 4 * rounds
        assert metrics["rollout/surplus_groups"] == len(kept) - 3 and metrics["rollout/filter_exhausted"] == 0
        for i in range(0, 12, 4):
            assert len({reward for _, reward in samples[i : i + 4]}) > 1  # no tied group survived
    assert (state["epoch"], state["position"]) == divmod(drawn, NUM_ROWS)  # every draw counted, filtered or not
