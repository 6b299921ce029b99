"""Rollout samples -> training samples: a ``generate_fn`` returning several samples per trajectory (each
trains with the trajectory's group score), the ``rollout.sample_to_train`` hook and its example, and the
errors that name the hook. The real engine and trainer run in
tests/integration/test_train_samples_run.py."""

from __future__ import annotations

import pytest
import torch

from minimal_config import run_config
from rlrun.data.sample import Prompt, Sample
from rlrun.rollout.debug_data import load_rollout, save_rollout
from rlrun.rollout.multiturn import run_generate_fn
from rlrun.rollout.train_samples import SampleToTrain, train_samples
from rlrun.runtime.hooks import HookSpecError
from rlrun.trainer.batch import BatchPlanner

PER_TURN = "examples/hooks/train_samples.py:per_turn"


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class CountingEngine:
    """Answers each input with ``len(input) % 3 + 1`` tokens; records every call's seed."""

    def __init__(self):
        self.seeds = []

    def generate(self, input_ids, sampling_params, return_logprob=True):
        out = []
        for ids, p in zip(input_ids, sampling_params, strict=True):
            self.seeds.append(p["sampling_seed"])
            tokens = [ord("a") + k for k in range(len(ids) % 3 + 1)]
            out.append(
                {"output_ids": tokens, "output_logprobs": [-0.5] * len(tokens), "finish_reason": {"type": "stop"}}
            )
        return out


async def answer_and_check(traj):
    await traj.generate()
    check = traj.fork("check:")
    await check.generate()
    return [traj.to_sample(), check.to_sample()]


async def wrong_prompt(traj):
    await traj.generate()
    other = traj.to_sample()
    other.group_index += 1
    return [other]


def sample(index: int, prompt: list[int], response: list[int], mask=None, reward=0.0) -> Sample:
    return Sample(
        group_index=index,
        prompt=Prompt(index, prompt, "q"),
        response_ids=response,
        response_text="",
        rollout_logprobs=[-0.1] * len(response),
        finish_reason="stop",
        reward=reward,
        loss_mask=mask,
    )


def test_a_trajectory_returning_a_list_yields_its_parts():
    engine, tokenizer = CountingEngine(), CharTokenizer()
    prompts = [Prompt(i, [ord(c) for c in f"q{i}"], f"q{i}", label=i) for i in range(2)]
    args = ({"max_new_tokens": 8, "n": 2}, 7, tokenizer, 64)
    trajectories = run_generate_fn(answer_and_check, engine, prompts, 2, *args)
    assert [t.group_index for t in trajectories] == [0, 0, 1, 1]  # prompt-major, one per trajectory
    for t in trajectories:
        first, check = t.parts
        assert check.prompt.prompt_ids == [ord(c) for c in "check:"] and check.prompt.label == t.prompt.label
        assert first.prompt.prompt_ids == prompts[t.group_index].prompt_ids
        assert t.response_ids == check.response_ids and t.prompt.prompt_ids == check.prompt.prompt_ids
        assert train_samples(t) == [first, check]
    # A fork draws under its own seeds (prompts sharing a seed still differ: the engine mixes in the tokens).
    assert len(engine.seeds) == 8 and len(set(engine.seeds)) == 4
    with pytest.raises(ValueError, match=r"returned samples of prompts \[1\] for prompt 0"):
        run_generate_fn(wrong_prompt, engine, prompts[:1], 1, *args)


def test_the_planner_trains_every_part_with_its_trajectorys_score():
    cfg = run_config({"rollout": {"samples_per_prompt": 2, "prompts_per_step": 2}})
    trajectories = []
    for g, rewards in enumerate([(1.0, 0.0), (0.0, 3.0)]):
        for k, reward in enumerate(rewards):
            parts = [sample(g, [1, 2], [10 + k] * (2 + k)), sample(g, [5, 6, 7], [20 + g] * 3)]
            trajectories.append(Sample(**{**vars(parts[-1]), "reward": reward, "parts": parts}))
    metrics = {}
    [batch] = BatchPlanner(cfg, [0], 1, pad_token_id=0).plan(trajectories, metrics)
    assert metrics["rollout/train_samples"] == 8
    mbs = batch.micro_batches
    assert sum(mb.num_loss_samples for mb in mbs) == 8
    assert sum(mb.num_loss_tokens for mb in mbs) == sum(len(p.response_ids) for t in trajectories for p in t.parts)
    assert batch.updates[0].num_global_tokens == sum(mb.num_loss_tokens for mb in mbs)
    # Each trained sequence's advantage is its trajectory's GRPO score: (r - mean) / std over the group.
    by_tokens = {}
    for mb in mbs:
        ids = mb.sample_ids[0]
        for i in ids.unique().tolist():
            if i < 0:
                continue
            keep = (ids == i) & (mb.loss_mask[0] > 0)
            tokens = tuple(mb.tokens[0, 1:][keep].tolist())
            by_tokens.setdefault(tokens, set()).add(round(mb.advantages[0][keep].unique().item(), 4))
    for t in trajectories:
        group = torch.tensor([s.reward for s in trajectories if s.group_index == t.group_index])
        expected = round(((t.reward - group.mean()) / group.std()).item(), 4)
        for part in t.parts:
            assert expected in by_tokens[tuple(part.response_ids)]


def test_sample_to_train_hook_splits_turns():
    hook = SampleToTrain.load(PER_TURN)
    multi = sample(3, [1, 2], [10, 11, 90, 91, 12, 92], mask=[1, 1, 0, 0, 1, 0])
    first, second = train_samples(multi, hook)
    assert (first.prompt.prompt_ids, first.response_ids) == ([1, 2], [10, 11])
    assert (second.prompt.prompt_ids, second.response_ids) == ([1, 2, 10, 11, 90, 91], [12])
    assert first.loss_mask is None and len(second.rollout_logprobs) == 1
    cfg = run_config({"rollout": {"samples_per_prompt": 2, "prompts_per_step": 1}})
    group = [multi, sample(3, [1, 2], [13, 14], reward=1.0)]
    metrics = {}
    BatchPlanner(cfg, [0], 1, pad_token_id=0, sample_to_train=hook).plan(group, metrics)
    assert metrics["rollout/train_samples"] == 3


def broken(s):
    return [Sample(**{**vars(s), "rollout_logprobs": []})]


def test_hook_errors_name_the_key_and_the_fault(tmp_path):
    with pytest.raises(HookSpecError, match=r"rollout.sample_to_train \('examples/hooks/train_samples.py:nope'\)"):
        SampleToTrain.load("examples/hooks/train_samples.py:nope")
    hook = SampleToTrain(broken, "x.py:broken")
    with pytest.raises(ValueError, match=r"\('x.py:broken'\) returned a sample of prompt 0 with \{'rollout_logprobs'"):
        train_samples(sample(0, [1], [2, 3]), hook)
    with pytest.raises(TypeError, match=r"returned Sample for prompt 0; it must return a list of Sample"):
        train_samples(sample(0, [1], [2]), SampleToTrain(lambda s: s, "y.py:f"))


def test_saved_rollouts_keep_the_parts(tmp_path):
    parts = [sample(0, [1], [2]), sample(0, [3], [4, 5])]
    trajectory = Sample(**{**vars(parts[-1]), "parts": parts})
    save_rollout(tmp_path, 0, [trajectory])
    [loaded] = load_rollout(tmp_path, 0)
    assert loaded.parts == parts and loaded.response_ids == [4, 5]


def test_saved_rollouts_keep_routed_experts_and_kept_sets(tmp_path):
    """MoE routing replay and top-p replay read these tensors from a saved rollout (debug.load_rollout_data)."""
    experts = torch.tensor([[[0, 3]], [[1, 2]], [[1, 2]]], dtype=torch.int32)  # [total_length, layers, topk]
    kept = torch.tensor([[5, 7, -1], [2, -1, -1]], dtype=torch.int32)  # [response tokens, width]
    saved = Sample(**{**vars(sample(0, [1], [2, 3])), "routed_experts": experts, "kept_ids": kept})
    save_rollout(tmp_path, 0, [saved])
    [loaded] = load_rollout(tmp_path, 0)
    for name, want in (("routed_experts", experts), ("kept_ids", kept)):
        got = getattr(loaded, name)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.int32 and torch.equal(got, want), name
