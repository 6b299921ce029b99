"""The algorithm tables (rlrun/algo/estimators.py, rlrun/algo/losses/): every entry's stages and loss exist,
an entry's settings come from the flat fields old configs use or from its mapping, ``algorithm.policy_loss``
is split from the estimator, and no module outside ``rlrun/algo`` compares estimator or loss names."""

import ast
import importlib
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import ValidationError

from rlrun.algo import entries, specs
from rlrun.algo.advantages import GROUP_BASELINES
from rlrun.algo.estimators import ESTIMATORS
from rlrun.algo.losses import POLICY_LOSSES
from rlrun.algo.objective import policy_terms
from rlrun.algo.rank_advantages import TOKEN_STAGES
from rlrun.algo.validate import algorithm_problems
from rlrun.config.schema import AlgorithmConfig, CriticConfig, RunConfig
from rlrun.trainer.roles import can_reuse_logprobs

RLRUN = Path(__file__).resolve().parents[2] / "rlrun"


def test_every_stage_an_entry_names_has_an_implementation():
    assert set(GROUP_BASELINES) == set(get_args(entries.GroupBaseline))
    assert set(TOKEN_STAGES) == set(get_args(entries.TokenStage))
    for name, entry in ESTIMATORS.items():
        assert entry.name == name and issubclass(entry.settings, entries.Settings), name
        assert entry.baseline in GROUP_BASELINES and entry.token_stage in TOKEN_STAGES, name
        assert entry.policy_loss in POLICY_LOSSES, name
        assert "normalize_std" in entry.settings.model_fields or entry.baseline != "normalised", name
        needs = {"returns": {"gamma"}, "gae": {"gamma", "lambd"}}.get(entry.token_stage, set())
        assert needs <= set(entry.settings.model_fields), name


def test_a_policy_loss_is_one_module_and_the_table_holds_every_module():
    modules = sorted(p.stem for p in (RLRUN / "algo" / "losses").glob("*.py") if p.stem != "__init__")
    found = {importlib.import_module(f"rlrun.algo.losses.{m}").ENTRY.name: m for m in modules}
    assert set(found) == set(POLICY_LOSSES)
    for name, entry in POLICY_LOSSES.items():
        assert entry.name == name and issubclass(entry.settings, entries.Settings), name


def test_the_config_names_entries_without_importing_algo():
    tree = ast.parse((RLRUN / "config" / "schema.py").read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in modules if m.startswith("rlrun.algo")]
    assert AlgorithmConfig(policy_loss="not_a_loss").policy_loss_name == "not_a_loss"  # names are algo's to check


@pytest.mark.parametrize(
    "estimator, loss", [("grpo", "ppo_clip"), ("gspo", "gspo"), ("cispo", "cispo"), ("ppo", "ppo_clip")]
)
def test_old_estimator_names_imply_their_loss(estimator, loss):
    assert specs.policy_loss(AlgorithmConfig(advantage_estimator=estimator)).entry.name == loss


def test_flat_fields_are_the_settings_defaults_and_the_mapping_wins():
    flat = AlgorithmConfig(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4)
    mapped = AlgorithmConfig(policy_loss={"name": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4})
    assert specs.policy_loss(flat).settings == specs.policy_loss(mapped).settings
    assert specs.policy_loss(mapped).settings.clip_high == 4e-4
    both = AlgorithmConfig(eps_clip=0.3, policy_loss={"name": "ppo_clip", "eps_clip": 0.1})
    assert specs.policy_loss(both).settings.eps_clip == 0.1
    assert specs.estimator(AlgorithmConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.5)).settings.lambd == 0.5
    gae = AlgorithmConfig(advantage_estimator={"name": "ppo", "lambd": 0.95})
    assert (specs.estimator(gae).settings.gamma, specs.estimator(gae).settings.lambd) == (1.0, 0.95)


def test_policy_loss_overrides_the_estimators_and_matches_it():
    gen = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 7, generator=gen) * 0.3 for _ in range(3))
    mask = (torch.rand(3, 7, generator=gen) > 0.3).float()
    split = AlgorithmConfig(advantage_estimator="grpo", policy_loss="gspo")
    implied = AlgorithmConfig(advantage_estimator="gspo")
    assert specs.policy_loss(split).entry.name == "gspo"
    a, b = policy_terms(split, logp, old, adv, mask), policy_terms(implied, logp, old, adv, mask)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.clipped, b.clipped)
    ppo = policy_terms(AlgorithmConfig(), logp, old, adv, mask)
    assert not torch.equal(ppo.loss, a.loss)  # the override really changes the loss
    assert not can_reuse_logprobs(split)  # the GSPO loss needs the old forward, whatever the estimator
    assert can_reuse_logprobs(AlgorithmConfig(advantage_estimator="gspo", policy_loss="ppo_clip"))


def test_mapping_settings_reach_the_loss():
    gen = torch.Generator().manual_seed(1)
    logp, old, adv = (torch.randn(2, 5, generator=gen) for _ in range(3))
    mask = torch.ones(2, 5)
    wide = policy_terms(AlgorithmConfig(policy_loss={"name": "ppo_clip", "eps_clip": 10.0}), logp, old, adv, mask)
    assert torch.equal(wide.loss, -adv * torch.exp(logp - old)) and wide.clipped.sum() == 0  # never clipped


def problems_of(algorithm: dict) -> list[tuple[str, str]]:
    run = RunConfig.model_construct(algorithm=AlgorithmConfig.model_validate(algorithm), critic=CriticConfig())
    return algorithm_problems(run)


def test_names_and_settings_are_checked_against_the_entries():
    with pytest.raises(ValidationError, match=r"algorithm.policy_loss \(cispo\) must be unset with loss_type sft"):
        AlgorithmConfig(loss_type="sft", policy_loss="cispo")
    [(key, message)] = problems_of({"policy_loss": "ppo"})
    assert key == "algorithm.policy_loss"
    assert message.startswith("algorithm.policy_loss (ppo) must be one of ppo_clip, gspo, cispo")
    [(key, message)] = problems_of({"advantage_estimator": "grpo2"})
    assert message.startswith("algorithm.advantage_estimator (grpo2) must be one of grpo, gspo, cispo")
    [(key, message)] = problems_of({"policy_loss": {"name": "cispo", "eps_clip_c": 3}})
    assert key == "algorithm.policy_loss.eps_clip_c"
    assert message.startswith("algorithm.policy_loss.eps_clip_c (3) must be a setting of cispo because")
    [(key, message)] = problems_of({"advantage_estimator": {"name": "ppo", "lambd": 2}, "custom_advantage": "m:f"})
    assert (key, message) == ("algorithm.advantage_estimator.lambd", message)
    assert message.startswith("algorithm.advantage_estimator.lambd (2) must be less than or equal to 1")
    assert problems_of({"advantage_estimator": {"name": "gspo", "normalize_std": False}, "eps_clip": 0.1}) == []


def _names_compared(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines of comparisons (==, !=, in) with one of ``names`` as a string literal, bare or in a collection."""

    def literals(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [v for elt in node.elts for v in literals(elt)]
        return []

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(v in names for side in (node.left, *node.comparators) for v in literals(side))
    ]


def test_no_estimator_or_loss_names_compared_outside_algo():
    names = set(ESTIMATORS) | set(POLICY_LOSSES)
    found = {
        str(path.relative_to(RLRUN)): lines
        for path in RLRUN.rglob("*.py")
        if "algo" not in path.relative_to(RLRUN).parts
        and (lines := _names_compared(ast.parse(path.read_text()), names))
    }
    assert not found, f"compare estimator/loss names only in rlrun/algo (ask rlrun.algo.specs instead): {found}"
    assert _names_compared(ast.parse('x = cfg.advantage_estimator in ("ppo", "gspo")'), names) == [1]
