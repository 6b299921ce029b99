"""Per-token loss masks of multi-turn samples reach the micro-batch: tool / environment tokens get no
loss, no advantage and no rollout log-prob; samples without a mask train on every response token."""

from __future__ import annotations

import torch

from rlrun.data.batch import collate
from rlrun.data.sample import Prompt, Sample


def make(prompt_ids, response_ids, mask, logprobs):
    prompt = Prompt(index=0, prompt_ids=prompt_ids, prompt_text="")
    return Sample(
        group_index=0,
        prompt=prompt,
        response_ids=response_ids,
        response_text="",
        rollout_logprobs=logprobs,
        finish_reason="stop",
        loss_mask=mask,
    )


def test_collate_honours_the_loss_mask():
    masked = make([1, 2, 3], [10, 11, 12, 13, 14], [1, 1, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, -0.5])
    plain = make([1, 2], [20, 21], None, [-0.3, -0.4])
    mb = collate([masked, plain], [2.0, -1.0], pad_token_id=0)
    # Position t predicts token t + 1: response token j of a sample at offset o with prompt length P
    # sits at t = o + P - 1 + j; the second sample starts at offset 8 (the row is packed, then padded).
    expected_mask = torch.zeros(1, 15)
    for j, m in enumerate([1, 1, 0, 0, 1]):
        expected_mask[0, 2 + j] = m
    expected_mask[0, 9:11] = 1
    assert torch.equal(mb.loss_mask, expected_mask)
    expected_adv = expected_mask.clone()
    expected_adv[0, :8] *= 2.0
    expected_adv[0, 8:] *= -1.0
    assert torch.equal(mb.advantages, expected_adv)
    assert torch.allclose(mb.rollout_logprobs[0, 2:7], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.5]))
    assert mb.num_loss_tokens == masked.num_loss_tokens + plain.num_loss_tokens == 5
    assert mb.tokens[0, :12].tolist() == [1, 2, 3, 10, 11, 12, 13, 14, 1, 2, 20, 21]  # environment tokens stay
