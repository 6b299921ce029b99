"""Training micro-batches: scored samples packed under a token budget and balanced across DP ranks.

Layout: each micro-batch holds whole samples, right-padded to its longest sample. Position ``t`` of
the ``[B, S-1]`` tensors describes the prediction of ``tokens[:, t + 1]``, so response token ``j`` of
a sample with prompt length ``P`` sits at ``t = P - 1 + j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrun.data.sample import Sample


@dataclass
class MicroBatch:
    """One forward/backward unit on one DP rank.

    tokens, position_ids: ``[B, S]`` int64; padding is ``pad_token_id`` after the real tokens.
    loss_mask: ``[B, S-1]`` float, 1.0 where the target is a response token the model generated
    (``Sample.loss_mask``; tool / environment tokens of multi-turn samples are 0).
    advantages, rollout_logprobs: ``[B, S-1]`` float, zero outside the loss mask. Rank 0 writes each
    sample's group score (``rlrun.algo.advantages.group_scores``) broadcast over its response tokens;
    the rank's advantage step (``rlrun.algo.rank_advantages``) replaces it with per-token advantages.
    old_logprobs: ``[B, S-1]``, filled by the trainer's forward before training (None until then, and
    None for good when the training forward reuses its own log-probs; see ``rlrun.roles``).
    ref_logprobs, teacher_logprobs: ``[B, S-1]`` from the reference / teacher weights (None when unused).
    returns: ``[B, S-1]`` per-token returns of the advantage estimator (None until computed).
    values: ``[B, S-1]`` critic values for GAE (None: no critic).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def without_loss(self) -> MicroBatch:
        """A copy that contributes no gradient: for a DP rank that would otherwise have no work."""
        return MicroBatch(
            tokens=self.tokens,
            position_ids=self.position_ids,
            loss_mask=torch.zeros_like(self.loss_mask),
            advantages=torch.zeros_like(self.advantages),
            rollout_logprobs=self.rollout_logprobs,
        )


def collate(samples: list[Sample], advantages: list[float], pad_token_id: int) -> MicroBatch:
    """Right-pad ``samples`` into one micro-batch; ``advantages[i]`` applies to every token of sample i
    that its ``loss_mask`` keeps (all response tokens when it has none)."""
    seq_len = max(s.total_length for s in samples)
    batch = len(samples)
    tokens = torch.full((batch, seq_len), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len - 1)
    adv = torch.zeros(batch, seq_len - 1)
    rollout_lp = torch.zeros(batch, seq_len - 1)
    for i, (sample, advantage) in enumerate(zip(samples, advantages)):
        prompt_len, resp_len = len(sample.prompt.prompt_ids), len(sample.response_ids)
        tokens[i, : prompt_len + resp_len] = torch.tensor(sample.prompt.prompt_ids + sample.response_ids)
        span = slice(prompt_len - 1, prompt_len - 1 + resp_len)
        mask = torch.ones(resp_len) if sample.loss_mask is None else torch.tensor(sample.loss_mask, dtype=torch.float32)
        loss_mask[i, span] = mask
        adv[i, span] = advantage * mask
        rollout_lp[i, span] = torch.tensor(sample.rollout_logprobs) * mask
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, -1).contiguous()
    return MicroBatch(tokens, position_ids, loss_mask, adv, rollout_lp)


def balance_across_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Assign item indices to ranks, longest first to the least-loaded rank (LPT greedy).

    The token loads differ by at most one item's length; every rank gets at least one item when
    there are at least ``num_ranks`` items.
    """
    loads = [0] * num_ranks
    assignment: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        rank = min(range(num_ranks), key=lambda r: (loads[r], len(assignment[r])))
        assignment[rank].append(index)
        loads[rank] += lengths[index]
    return assignment


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group item indices into micro-batches whose padded size (count x longest) fits ``max_tokens``.

    Items are taken shortest first so similar lengths share padding. An item longer than the budget
    gets a micro-batch of its own rather than being dropped.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[index]  # ascending order: the newcomer is the longest so far
        if current and (len(current) + 1) * longest > max_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def schedule_micro_batches(
    samples: list[Sample],
    advantages: list[float],
    dp_size: int,
    max_tokens: int,
    pad_token_id: int,
) -> list[list[MicroBatch]]:
    """Per DP rank, the micro-batches it trains on. Every rank gets at least one micro-batch
    (a loss-free copy when there are fewer samples than ranks) so all ranks join the gradient reduce."""
    if not samples:
        raise ValueError("cannot schedule an empty batch: every group was filtered out")
    lengths = [s.total_length for s in samples]
    per_rank: list[list[MicroBatch]] = []
    for indices in balance_across_ranks(lengths, dp_size):
        packed = pack_micro_batches([lengths[i] for i in indices], max_tokens)
        per_rank.append(
            [collate([samples[indices[j]] for j in mb], [advantages[indices[j]] for j in mb], pad_token_id) for mb in packed]
        )
    filler = next(mbs[0] for mbs in per_rank if mbs).without_loss()
    return [mbs if mbs else [filler] for mbs in per_rank]
