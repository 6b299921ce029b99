"""``rlrun doctor --plan`` (rlrun/tools/cluster_plan.py): the published models' sizes, expert sharding in the trainer
estimate, and the verdicts of the recipe table."""

from __future__ import annotations

import pytest

from rlrun.megatron.hf_config import ModelArch
from rlrun.tools.cluster_plan import MODELS, RECIPES, Recipe, peak, plan, recipe_config
from rlrun.tools.memory_estimate import GIB, estimate, rank_param_split, rank_params

PUBLISHED_BILLIONS = {"Qwen3-4B": 4.0, "Qwen3-8B": 8.2, "Qwen3-30B-A3B": 30.5, "Qwen3-235B-A22B": 235.0}
"""Total parameters on each model card."""


@pytest.mark.parametrize("model", sorted(MODELS))
def test_published_configs_have_the_published_size(model):
    arch = ModelArch.from_dict(MODELS[model])
    assert rank_params(arch, 1, 1, 1) / 1e9 == pytest.approx(PUBLISHED_BILLIONS[model], rel=0.02)


def test_routed_experts_split_over_ep_etp_and_pp_and_their_optimizer_over_expert_dp():
    arch = ModelArch.from_dict(MODELS["Qwen3-30B-A3B"])
    dense1, routed1 = rank_param_split(arch, 1, 1, 1)
    dense, routed = rank_param_split(arch, 1, 2, 4, 2)
    assert routed == pytest.approx(routed1 / 16)
    assert routed1 == 48 * 128 * 3 * 2048 * 768  # layers x experts x (gate, up, down) x hidden x expert width

    cfg = recipe_config(
        Recipe("Qwen3-30B-A3B", 16, 80, {"parallel.ep": 8, "optimizer.use_distributed_optimizer": True})
    )
    e = estimate(cfg, arch, dp=16)
    dense, routed = rank_param_split(arch, 1, 1, 8)
    # bf16: fp32 main weights (4) and Adam moments (8) sharded: dense over dp 16, routed over 16 / 8 expert-dp ranks
    assert e.optimizer_gib == pytest.approx((dense * 12 / 16 + routed * 12 / 2) / GIB)
    assert e.weights_gib == pytest.approx((dense + routed) * 2 / GIB)


def test_plan_verdicts_and_fixes():
    rows = plan()
    assert len(rows) == len(RECIPES)
    assert {r.recipe.model for r in rows} == set(MODELS)
    for row in rows:
        assert row.fits == (row.peak_gib <= row.recipe.gpu_gib)
        assert bool(row.fixes) != row.fits
    assert any(r.fits for r in rows) and not all(r.fits for r in rows)
    # a suggested layout, applied, fits
    for row in rows:
        suggestion = next((f for f in row.fixes if f.startswith("or set parallel.")), None)
        if suggestion is None:
            continue
        settings = dict(kv.split("=") for kv in suggestion.removeprefix("or set ").split(" (")[0].split())
        _, _, phase = peak(row.recipe, {k: int(v) for k, v in settings.items()})
        assert phase.total_gib <= row.recipe.gpu_gib


def test_layout_that_does_not_divide_the_gpus_is_refused():
    with pytest.raises(ValueError, match="does not divide 16 GPUs"):
        peak(Recipe("Qwen3-30B-A3B", 16, 80, {"parallel.ep": 32}))


def test_operations_doc_holds_todays_table():
    from pathlib import Path

    from rlrun.tools.cluster_plan import markdown

    doc = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()
    assert markdown(plan()) in doc, "regenerate the Clusters table in docs/operations.md (rlrun doctor --plan)"
