"""Per-sample algorithm terms on packed rows equal the same terms on one-sample-per-row tensors.

Reference: the row layout (``sample_ids=None``), where each row is one sample; the packed layout puts
both samples in one row with a boundary position (sample id -1, mask 0) between them, as
``rlrun.data.batch.collate`` does.
"""

from __future__ import annotations

import pytest
import torch

from rlrun.algo.advantages import gae, last_token_mask, reinforce_returns
from rlrun.algo.aggregate import Aggregator, StepCounts
from rlrun.algo.mismatch import level_log_ratio
from rlrun.algo.policy_loss import gspo_log_ratio
from rlrun.algo.segments import sample_sum

LENGTHS = (6, 4)


def rows_and_packed(seed: int, mask: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Two samples as ``[2, 6]`` rows (the shorter one zero-padded) and as one ``[1, 11]`` packed row."""
    gen = torch.Generator().manual_seed(seed)
    values = [(torch.rand(n, generator=gen) < 0.7).float() if mask else torch.randn(n, generator=gen) for n in LENGTHS]
    if mask:
        values[0][-1], values[1][0] = 1.0, 1.0  # both samples have loss tokens
        values[0][0] = 0.0  # a prompt position
    rows = torch.zeros(2, max(LENGTHS))
    for i, v in enumerate(values):
        rows[i, : len(v)] = v
    packed = torch.cat([values[0], torch.zeros(1), values[1]]).unsqueeze(0)
    return rows, packed


PACKED_IDS = torch.tensor([[0] * LENGTHS[0] + [-1] + [1] * LENGTHS[1]])


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The packed row's positions back in the row layout (zero-padded)."""
    rows = torch.zeros(2, max(LENGTHS))
    rows[0, : LENGTHS[0]] = packed[0, : LENGTHS[0]]
    rows[1, : LENGTHS[1]] = packed[0, LENGTHS[0] + 1 :]
    return rows


def test_sample_sum_per_sample_not_per_row():
    rows, packed = rows_and_packed(0)
    totals = sample_sum(packed, PACKED_IDS)
    assert totals[0, 0].item() == pytest.approx(rows[0].sum().item(), abs=1e-6)
    assert totals[0, -1].item() == pytest.approx(rows[1].sum().item(), abs=1e-6)
    assert totals[0, LENGTHS[0]].item() == 0.0  # the boundary belongs to no sample


def test_sequence_level_terms_match_the_row_layout():
    mask_rows, mask_packed = rows_and_packed(1, mask=True)
    lp_rows, lp_packed = rows_and_packed(2)
    old_rows, old_packed = rows_and_packed(3)
    got = gspo_log_ratio(lp_packed, old_packed, mask_packed, PACKED_IDS)
    torch.testing.assert_close(unpack(got) * mask_rows, gspo_log_ratio(lp_rows, old_rows, mask_rows) * mask_rows)
    for level in ("sequence", "geometric"):
        got = level_log_ratio(lp_packed - old_packed, mask_packed, level, PACKED_IDS)
        want = level_log_ratio(lp_rows - old_rows, mask_rows, level)
        torch.testing.assert_close(unpack(got) * mask_rows, want * mask_rows)


def test_sample_aggregation_matches_the_row_layout():
    mask_rows, mask_packed = rows_and_packed(4, mask=True)
    x_rows, x_packed = rows_and_packed(5)
    counts = StepCounts(num_tokens=int(mask_rows.sum()), num_samples=2, max_response_len=8)
    packed = Aggregator(mask_packed, "sample", counts, PACKED_IDS)(x_packed)
    rows = Aggregator(mask_rows, "sample", counts)(x_rows)
    # independent: the mean over samples of each sample's masked mean, times N_tok
    by_hand = sum((x * m).sum() / m.sum() for x, m in zip(x_rows, mask_rows, strict=False)) / 2 * counts.num_tokens
    assert packed.item() == pytest.approx(rows.item(), rel=1e-6)
    assert packed.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_returns_do_not_flow_across_samples():
    mask_rows, mask_packed = rows_and_packed(6, mask=True)
    scores_rows = torch.tensor([[1.5], [-2.0]]) * mask_rows
    scores_packed = torch.cat([scores_rows[0, : LENGTHS[0]], torch.zeros(1), scores_rows[1, : LENGTHS[1]]])[None]
    values_rows, values_packed = rows_and_packed(7)
    torch.testing.assert_close(unpack(last_token_mask(mask_packed, PACKED_IDS)), last_token_mask(mask_rows))
    got = reinforce_returns(scores_packed, mask_packed, None, 0.0, 0.9, PACKED_IDS)
    torch.testing.assert_close(unpack(got), reinforce_returns(scores_rows, mask_rows, None, 0.0, 0.9))
    rewards_packed = scores_packed * last_token_mask(mask_packed, PACKED_IDS)
    rewards_rows = scores_rows * last_token_mask(mask_rows)
    adv_p, ret_p = gae(rewards_packed, values_packed, mask_packed, 0.9, 0.8, PACKED_IDS)
    adv_r, ret_r = gae(rewards_rows, values_rows, mask_rows, 0.9, 0.8)
    torch.testing.assert_close(unpack(adv_p), adv_r)
    torch.testing.assert_close(unpack(ret_p), ret_r)
    # without sample ids the second sample's reward leaks into the first one's returns
    leaked = reinforce_returns(scores_packed, mask_packed, None, 0.0, 0.9)
    assert not torch.allclose(unpack(leaked), reinforce_returns(scores_rows, mask_rows, None, 0.0, 0.9))
