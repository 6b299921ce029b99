"""Micro-batch collation, packing under a token budget, and DP balancing."""

import pytest
import torch

from rlrun.data.batch import balance_across_ranks, collate, pack_micro_batches, schedule_micro_batches
from rlrun.data.sample import Prompt, Sample


def make_sample(prompt_len: int, resp_len: int, index: int = 0) -> Sample:
    prompt = Prompt(index=index, prompt_ids=list(range(10, 10 + prompt_len)), prompt_text="p")
    return Sample(
        group_index=index,
        prompt=prompt,
        response_ids=list(range(100, 100 + resp_len)),
        response_text="r",
        rollout_logprobs=[-0.1 * (j + 1) for j in range(resp_len)],
        finish_reason="stop",
    )


def test_collate_packs_samples_into_one_row():
    samples = [make_sample(3, 2), make_sample(2, 4)]
    mb = collate(samples, [0.5, -1.0], pad_token_id=0)
    assert mb.tokens.shape == (1, 16)  # 5 + 6 tokens padded to a multiple of ROW_MULTIPLE
    assert mb.tokens[0, 11:].tolist() == [0] * 5
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    # loss positions t predict tokens[t+1]; per sample they must be exactly its response tokens
    ids = mb.sample_ids[0]
    assert ids.tolist() == [0] * 4 + [-1] + [1] * 10
    for i, s in enumerate(samples):
        keep = mb.loss_mask[0].bool() & (ids == i)
        assert mb.tokens[0, 1:][keep].tolist() == s.response_ids
        assert mb.rollout_logprobs[0][keep].tolist() == torch.tensor(s.rollout_logprobs).tolist()
    assert mb.advantages[0][ids == 0].sum().item() == 0.5 * 2
    assert mb.num_loss_tokens == 6 and mb.num_loss_samples == 2
    assert mb.teacher_logprobs is None  # no teacher engine scored them


def test_collate_places_teacher_logprobs_at_the_response_predictions():
    """The teacher engine's scores sit where ``rollout_logprobs`` do, unmasked (a tool token's too), 0 elsewhere."""
    samples = [make_sample(3, 2), make_sample(2, 4)]
    samples[1].loss_mask = [1, 0, 1, 1]
    for k, s in enumerate(samples):
        s.teacher_logprobs = [-1.0 - k - 0.25 * j for j in range(len(s.response_ids))]
    teacher = collate(samples, [0.5, -1.0], pad_token_id=0).teacher_logprobs
    assert teacher is not None and teacher.shape == (1, 15)
    want = [0.0] * 2 + [-1.0, -1.25] + [0.0] * 2 + [-2.0, -2.25, -2.5, -2.75] + [0.0] * 5
    assert teacher[0].tolist() == want


def _collate_sample_by_sample(samples, advantages, pad_token_id):
    """The packed row written out one sample at a time: the reference for ``collate``'s whole-row indexing."""
    total = sum(s.total_length for s in samples)
    seq_len = -(-total // 8) * 8
    tokens = torch.full((1, seq_len), pad_token_id, dtype=torch.long)
    positions = torch.zeros(1, seq_len, dtype=torch.long)
    loss_mask, adv, rollout, teacher = (torch.zeros(1, seq_len - 1) for _ in range(4))
    offset = 0
    for s, a in zip(samples, advantages, strict=True):
        p, r = len(s.prompt.prompt_ids), len(s.response_ids)
        tokens[0, offset : offset + p + r] = torch.tensor(s.prompt.prompt_ids + s.response_ids)
        positions[0, offset : offset + p + r] = torch.arange(p + r)
        span = slice(offset + p - 1, offset + p + r - 1)
        mask = torch.ones(r) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        loss_mask[0, span], adv[0, span] = mask, a * mask
        rollout[0, span] = torch.tensor(s.rollout_logprobs) * mask
        teacher[0, span] = torch.tensor(s.teacher_logprobs)
        offset += p + r
    last = samples[-1].total_length
    positions[0, offset:] = torch.arange(last, last + seq_len - offset)
    return tokens, positions, loss_mask, adv, rollout, teacher


def test_collate_matches_packing_sample_by_sample():
    """Random prompts, responses (one empty), loss masks on some samples, teacher scores: bitwise the row that
    writing each sample's slices in turn gives."""
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i, (p, r) in enumerate([(5, 7), (1, 13), (9, 0), (3, 4), (12, 21)]):
        s = make_sample(p, r, index=i)
        s.rollout_logprobs = (-torch.rand(r, generator=gen)).tolist()
        s.teacher_logprobs = (-torch.rand(r, generator=gen)).tolist()
        if i % 2:
            s.loss_mask = (torch.rand(r, generator=gen) < 0.6).int().tolist()
        samples.append(s)
    advantages = torch.randn(len(samples), generator=gen).tolist()
    mb = collate(samples, advantages, pad_token_id=3)
    want = _collate_sample_by_sample(samples, advantages, pad_token_id=3)
    got = (mb.tokens, mb.position_ids, mb.loss_mask, mb.advantages, mb.rollout_logprobs, mb.teacher_logprobs)
    names = ("tokens", "positions", "loss_mask", "advantages", "rollout", "teacher")
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


def test_collate_refuses_per_token_lists_that_do_not_match_the_response():
    sample = make_sample(3, 4)
    sample.rollout_logprobs = sample.rollout_logprobs[:3]
    with pytest.raises(ValueError, match="rollout_logprobs has 3 entries but the response has 4 tokens"):
        collate([make_sample(2, 2), sample], [1.0, 1.0], pad_token_id=0)


def test_pack_respects_budget_and_keeps_every_item():
    lengths = [5, 9, 3, 12, 7, 7, 30]
    batches = pack_micro_batches(lengths, max_tokens=24)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 24
    # first-fit decreasing: 30 | 12+9+3 | 7+7+5 is the 3-bin optimum for this list
    assert len(batches) == 3


def test_balance_is_within_one_item():
    lengths = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    assignment = balance_across_ranks(lengths, 3)
    loads = [sum(lengths[i] for i in r) for r in assignment]
    assert sorted(i for r in assignment for i in r) == list(range(len(lengths)))
    assert max(loads) - min(loads) <= max(lengths)


def test_schedule_gives_every_rank_work():
    per_rank = schedule_micro_batches([make_sample(3, 2)], [1.0], dp_size=2, max_tokens=64, pad_token_id=0)
    assert len(per_rank) == 2 and all(per_rank)
    total_loss_tokens = sum(mb.num_loss_tokens for mbs in per_rank for mb in mbs)
    assert total_loss_tokens == 2  # the filler micro-batch carries no loss


def test_context_parallel_schedules_one_unpacked_sample_per_micro_batch():
    samples = [make_sample(3, 2, 0), make_sample(2, 4, 1), make_sample(4, 1, 2)]
    (mbs,) = schedule_micro_batches(samples, [1.0] * 3, 1, 64, 0, one_sample_per_micro_batch=True)
    assert len(mbs) == 3 and all(mb.num_loss_samples == 1 for mb in mbs)
    for mb in mbs:  # positions 0..S-1: the unpacked path that context parallelism cuts into chunks
        assert mb.position_ids[0].tolist() == list(range(mb.tokens.shape[1]))
