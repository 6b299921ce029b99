"""CPU weight backups (exact swap in / out) and the log-prob reuse condition, term by term."""

import pytest
import torch

from rlrun.config.schema import AlgorithmConfig
from rlrun.megatron.weight_backup import WeightBackup
from rlrun.trainer.roles import can_reuse_logprobs


def test_backup_restore_and_copy_are_exact():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))  # params and buffers
    original = {k: v.clone() for k, v in module.state_dict().items()}
    backup = WeightBackup(module)
    backup.backup("actor")
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
        module[1].running_mean.add_(5.0)
    backup.backup("ref")
    changed = {k: v.clone() for k, v in module.state_dict().items()}
    backup.restore("actor")
    assert all(torch.equal(module.state_dict()[k], v) for k, v in original.items())
    backup.copy("ref", "old_actor")
    backup.restore("old_actor")
    assert all(torch.equal(module.state_dict()[k], v) for k, v in changed.items())
    assert backup.tags == ["actor", "ref", "old_actor"]
    # the backups are copies: later changes to the model do not leak into them
    with torch.no_grad():
        module[0].weight.zero_()
    backup.restore("actor")
    assert torch.equal(module[0].weight, original["0.weight"])
    with pytest.raises(KeyError, match="weight backup tag \\('teacher'\\) must be one of"):
        backup.restore("teacher")


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": "sft"},
        {"kl": {"reward_coef": 0.1}},
        {"use_rollout_logprobs": True},
        {"advantage_estimator": "gspo"},
        {"advantage_estimator": "ppo", "custom_advantage": "operator:setitem"},
        {"keep_old_actor": True},
        {"opd": {"teacher_path": "t", "kl_coef": 0.1}},
        {"custom_advantage": "operator:setitem"},
    ],
)
def test_each_condition_disables_reuse(overrides):
    assert can_reuse_logprobs(AlgorithmConfig())
    assert not can_reuse_logprobs(AlgorithmConfig(**overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {"kl": {"loss_coef": 0.1}},
        {"tis": {"mode": "clip"}},
        {"advantage_estimator": "cispo"},
        {"entropy_coef": 0.01},
        {"loss_aggregation": "sample"},
    ],
)
def test_loss_side_terms_keep_reuse(overrides):
    """KL loss, TIS, CISPO, entropy and aggregation only read the old log-probs inside the loss."""
    assert can_reuse_logprobs(AlgorithmConfig(**overrides))
    assert not can_reuse_logprobs(AlgorithmConfig(**overrides), num_optimizer_steps=2)
