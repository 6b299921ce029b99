"""Config checks of streaming rounds and partial rollout, and the off-policy mask against a hand count."""

from __future__ import annotations

import pytest

from rlrun.config.schema import RolloutConfig, RunConfig
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.collect import mask_older_weights


def test_streaming_config_refusals():
    assert RolloutConfig(partial_rollout=True).streams and not RolloutConfig().streams
    with pytest.raises(ValueError, match="rollout.generate_fn .* must be unset with rollout.abort_surplus"):
        RolloutConfig(abort_surplus=True, generate_fn="examples/calculator_tool/agent.py:generate")
    with pytest.raises(ValueError, match="must come with rollout.partial_rollout"):
        RolloutConfig(partial_rollout_mask_offpolicy=True)
    with pytest.raises(ValueError, match=r"engine.tp \(2\) must be 1"):
        RunConfig.model_validate({"rollout": {"partial_rollout": True}, "engine": {"tp": 2}})
    with pytest.raises(ValueError, match=r"engine.max_restarts \(1\) must be 0 with rollout.abort_surplus"):
        RunConfig.model_validate({"rollout": {"abort_surplus": True}, "engine": {"max_restarts": 1}})
    assert RunConfig.model_validate({"engine": {"max_restarts": 1}}).engine.max_restarts == 1


def test_mask_older_weights_zeroes_exactly_the_older_spans():
    prompt = Prompt(index=0, prompt_ids=[1], prompt_text="")
    sample = Sample(0, prompt, list(range(9)), "", [0.0] * 9, "stop", weight_version="3")
    sample.weight_spans = [("1", 2), ("2", 3), ("3", 4)]
    assert sample.first_weight_version == "1"
    assert mask_older_weights(sample) == 5 and sample.loss_mask == [0] * 5 + [1] * 4
    fresh = Sample(0, prompt, [5, 6], "", [0.0, 0.0], "stop", weight_version="3")
    assert mask_older_weights(fresh) == 0 and fresh.loss_mask is None


def test_carried_top_p_kept_sets_concatenate():
    import torch

    from rlrun.rollout.streaming import _concat_kept

    old = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32)
    new = torch.tensor([[4, 5, 6]], dtype=torch.int32)
    assert _concat_kept(old, new, 2).tolist() == [[1, 2, -1], [3, -1, -1], [4, 5, 6]]
    assert _concat_kept(None, new, 0) is new  # nothing carried: the continuation's own sets
    assert _concat_kept(old, None, 2) is None  # one side without a filter: no replay for the sample
