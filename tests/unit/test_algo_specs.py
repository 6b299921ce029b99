"""The algorithm tables (rlrun/algo/specs.py): every row's stages exist, ``algorithm.policy_loss`` is split
from the estimator (old configs keep their loss), and no module outside ``rlrun/algo`` compares
estimator or loss names."""

import ast
from pathlib import Path
from typing import get_args

import pytest
import torch

from rlrun.algo import specs
from rlrun.algo.advantages import GROUP_BASELINES
from rlrun.algo.objective import POLICY_LOSS_TERMS, policy_terms
from rlrun.algo.rank_advantages import TOKEN_STAGES
from rlrun.config import ConfigError, load_config
from rlrun.config.schema import AlgorithmConfig, KLConfig, TISConfig
from rlrun.trainer.roles import can_reuse_logprobs

RLRUN = Path(__file__).resolve().parents[2] / "rlrun"


def test_every_stage_a_row_names_has_an_implementation():
    assert set(GROUP_BASELINES) == set(get_args(specs.GroupBaseline))
    assert set(TOKEN_STAGES) == set(get_args(specs.TokenStage))
    assert set(POLICY_LOSS_TERMS) == set(specs.POLICY_LOSSES) == set(get_args(specs.PolicyLoss))
    for name, spec in specs.ESTIMATORS.items():
        assert spec.baseline in GROUP_BASELINES, name
        assert spec.token_stage in TOKEN_STAGES, name
        assert spec.policy_loss in POLICY_LOSS_TERMS, name


def test_schema_uses_the_algo_value_sets():
    fields = AlgorithmConfig.model_fields
    assert fields["advantage_estimator"].annotation is specs.Estimator
    assert fields["loss_aggregation"].annotation is specs.Aggregation
    assert KLConfig.model_fields["estimator"].annotation is specs.KLEstimator
    assert TISConfig.model_fields["mode"].annotation is specs.TISMode


@pytest.mark.parametrize(
    "estimator, loss", [("grpo", "ppo_clip"), ("gspo", "gspo"), ("cispo", "cispo"), ("ppo", "ppo_clip")]
)
def test_old_estimator_names_imply_their_loss(estimator, loss):
    assert AlgorithmConfig(advantage_estimator=estimator).resolved_policy_loss == loss


def test_policy_loss_overrides_the_estimators_and_matches_it():
    gen = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 7, generator=gen) * 0.3 for _ in range(3))
    mask = (torch.rand(3, 7, generator=gen) > 0.3).float()
    split = AlgorithmConfig(advantage_estimator="grpo", policy_loss="gspo")
    implied = AlgorithmConfig(advantage_estimator="gspo")
    assert split.resolved_policy_loss == "gspo"
    a, b = policy_terms(split, logp, old, adv, mask), policy_terms(implied, logp, old, adv, mask)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.clipped, b.clipped)
    ppo = policy_terms(AlgorithmConfig(), logp, old, adv, mask)
    assert not torch.equal(ppo.loss, a.loss)  # the override really changes the loss
    assert not can_reuse_logprobs(split)  # the GSPO loss needs the old forward, whatever the estimator
    assert can_reuse_logprobs(AlgorithmConfig(advantage_estimator="gspo", policy_loss="ppo_clip"))


def test_policy_loss_without_a_policy_term_fails_at_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  loss_type: sft\n  policy_loss: cispo\n")
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss \(cispo\) must be unset with loss_type sft"):
        load_config(path)
    path.write_text("algorithm:\n  policy_loss: ppo\n")
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss \('ppo'\) must be 'ppo_clip', 'gspo' or 'cispo'"):
        load_config(path)


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
    names = set(specs.ESTIMATORS) | set(specs.POLICY_LOSSES)
    found = {
        str(path.relative_to(RLRUN)): lines
        for path in RLRUN.rglob("*.py")
        if "algo" not in path.relative_to(RLRUN).parts
        and (lines := _names_compared(ast.parse(path.read_text()), names))
    }
    assert not found, f"compare estimator/loss names only in rlrun/algo (read algo.specs rows instead): {found}"
    assert _names_compared(ast.parse('x = cfg.advantage_estimator in ("ppo", "gspo")'), names) == [1]
