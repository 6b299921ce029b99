"""Config checks of streaming rounds and partial rollout, and the off-policy mask against a hand count."""

from __future__ import annotations

import pytest

from minimal_config import rollout_config, run_config
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.streaming import mask_older_weights


def test_streaming_config_refusals():
    assert rollout_config(partial_rollout=True).streams and not rollout_config().streams
    with pytest.raises(ValueError, match="rollout.generate_fn .* must be unset with rollout.abort_surplus"):
        rollout_config(abort_surplus=True, generate_fn="examples/calculator_tool/agent.py:generate")
    with pytest.raises(ValueError, match="must come with rollout.partial_rollout"):
        rollout_config(partial_rollout_mask_offpolicy=True)
    with pytest.raises(ValueError, match=r"engine.tp \(2\) must be 1"):
        run_config({"rollout": {"partial_rollout": True}, "engine": {"tp": 2}})
    with pytest.raises(ValueError, match=r"engine.max_restarts \(1\) must be 0 with rollout.abort_surplus"):
        run_config({"rollout": {"abort_surplus": True}, "engine": {"max_restarts": 1}})
    assert run_config({"engine": {"max_restarts": 1}}).engine.max_restarts == 1


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


def test_carry_survives_the_checkpoint_format_and_a_run_without_partial_rollout_refuses_it():
    import io

    import torch

    from rlrun.rollout.collect import RolloutRuntime
    from rlrun.rollout.streaming import carry_from_state, carry_to_state

    prompt = Prompt(index=7, prompt_ids=[1, 2], prompt_text="q", label={"answer": 3}, metadata={"source": "add"})
    sample = Sample(7, prompt, [5, 6, 7], "abc", [-0.5, -1.0, -2.0], "abort", weight_version="2", reward=0.0)
    sample.carried_tokens, sample.weight_spans = 1, [("1", 1), ("2", 2)]
    sample.kept_ids = torch.tensor([[5, -1], [6, 9], [7, -1]], dtype=torch.int32)
    sample.routed_experts = torch.zeros(5, 2, 2, dtype=torch.int32)
    sample.parts = [Sample(7, prompt, [5], "a", [-0.5], "stop", weight_spans=[("1", 1)])]
    buffer = io.BytesIO()
    torch.save(carry_to_state([[sample]]), buffer)
    buffer.seek(0)
    [[back]] = carry_from_state(torch.load(buffer, weights_only=True))  # plain data: no class unpickled
    for name in ("group_index", "prompt", "response_ids", "rollout_logprobs", "finish_reason", "carried_tokens"):
        assert getattr(back, name) == getattr(sample, name), name
    assert back.weight_spans == [("1", 1), ("2", 2)] and back.first_weight_version == "1"
    assert back.parts == sample.parts  # a trajectory's parts are samples again, not dicts
    assert torch.equal(back.kept_ids, sample.kept_ids) and torch.equal(back.routed_experts, sample.routed_experts)

    def runtime(partial: bool) -> RolloutRuntime:
        cfg = run_config({"rollout": {"partial_rollout": partial}})
        return RolloutRuntime(cfg=cfg, parallel=None, engine=None, tokenizer=None, sampler=None, hooks=None)

    with pytest.raises(ValueError, match=r"rollout.partial_rollout \(false\) must be true .* carries 1 drawn"):
        runtime(False).restore_carry(carry_to_state([[sample]]))
    runtime(False).restore_carry(None)  # a checkpoint without a carry resumes anywhere
    resumed = runtime(True)
    resumed.restore_carry(carry_to_state([[sample]]))
    assert [[s.response_ids for s in g] for g in resumed.carry] == [[[5, 6, 7]]]
