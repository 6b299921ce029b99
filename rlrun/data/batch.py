"""Training micro-batches: scored samples packed under a token budget and balanced across DP ranks.

Layout: ``collate`` packs every sample of a micro-batch into one row, back to back, and pads the row
to a multiple of ``ROW_MULTIPLE`` tokens. ``position_ids`` restart at 0 with each sample; that restart
is the whole packing description: the model keeps attention and RoPE positions inside each sample
(``rlrun.megatron.attention``), and ``MicroBatch.sample_ids`` tells the loss and advantage code which
positions belong to which sample (``rlrun.algo.segments``). Rows that each hold one sample with
positions ``0..S-1`` (tests, older callers) remain valid micro-batches.

Position ``t`` of the ``[B, S-1]`` tensors describes the prediction of ``tokens[:, t + 1]``, so response
token ``j`` of a sample starting at offset ``o`` with prompt length ``P`` sits at ``t = o + P - 1 + j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from rlrun.data.sample import Sample

ROW_MULTIPLE = 8
"""Packed rows are padded to a multiple of this many tokens: tensor-core friendly GEMM shapes, and
divisible by the TP size that Megatron's sequence parallelism would split them over."""


@dataclass
class MicroBatch:
    """One forward/backward unit on one DP rank.

    tokens, position_ids: ``[B, S]`` int64. Positions count 0, 1, ... within each sample and restart at 0
    for the next sample of the row; padding (``pad_token_id``) ends a row, its positions continuing the
    last sample's (causal attention keeps it from influencing any real token).
    loss_mask: ``[B, S-1]`` float, 1.0 where the target is a response token the model generated
    (``Sample.loss_mask``; tool / environment tokens of multi-turn samples are 0).
    advantages, rollout_logprobs: ``[B, S-1]`` float, zero outside the loss mask. Rank 0 writes each
    sample's group score (``rlrun.algo.advantages.group_scores``) broadcast over its response tokens;
    the rank's advantage step (``rlrun.algo.rank_advantages``) replaces it with per-token advantages.
    old_logprobs: ``[B, S-1]``, filled by the trainer's forward before training (None until then, and
    None for good when the training forward reuses its own log-probs; see ``rlrun.trainer.roles``).
    ref_logprobs, teacher_logprobs: ``[B, S-1]`` from the reference / teacher weights (None when unused).
    The trainer's log-probs are scored under the loss mask only: old, reference and teacher log-probs (and the
    training forward's) read 0 elsewhere with the chunked LM head (``model.lm_head``, the default).
    returns: ``[B, S-1]`` per-token returns of the advantage estimator (None until computed).
    values: ``[B, S-1]`` critic values for GAE (None: no critic).
    routed_experts: ``[B, S, moe_layers, topk]`` int32, the engine's expert ids of every token (rollout
    routing replay), aligned with ``tokens``: each sample's ``Sample.routed_experts`` at its offset; the
    row's padding repeats the last real token's ids (a causally inert, valid top-k). None when a sample
    has none.
    kept_ids: ``[B, S-1, W]`` int64, top-p mask replay: at a response token's position, the kept set it was
    drawn from (``Sample.kept_ids``), -1 padded; all -1 elsewhere (no replay there). None when no sample has one.
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
    routed_experts: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def sample_ids(self) -> torch.Tensor:
        """``[B, S-1]`` int64: which sample (numbered 0, 1, ... across the micro-batch's rows) position
        ``t`` predicts a token of; -1 where ``tokens[t + 1]`` starts a new sample (a prediction across
        a sample boundary, never in the loss)."""
        return sample_ids(self.position_ids)

    @property
    def num_loss_samples(self) -> int:
        """Samples with at least one loss token (``StepCounts.num_samples`` adds these up)."""
        ids = self.sample_ids[self.loss_mask > 0]
        return int(ids.unique().numel())

    def without_loss(self) -> MicroBatch:
        """A copy that contributes no gradient: for a DP rank that would otherwise have no work."""
        return MicroBatch(
            tokens=self.tokens,
            position_ids=self.position_ids,
            loss_mask=torch.zeros_like(self.loss_mask),
            advantages=torch.zeros_like(self.advantages),
            rollout_logprobs=self.rollout_logprobs,
            teacher_logprobs=self.teacher_logprobs,
            routed_experts=self.routed_experts,
            kept_ids=self.kept_ids,
        )


def sample_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``MicroBatch.sample_ids`` of ``position_ids [B, S]``: a new sample starts at every position 0."""
    starts = position_ids == 0
    ids = starts.reshape(-1).cumsum(0).reshape(starts.shape) - 1
    return torch.where(starts[:, 1:], torch.full_like(ids[:, :-1], -1), ids[:, :-1])


def collate(samples: list[Sample], advantages: list[float], pad_token_id: int) -> MicroBatch:
    """Pack ``samples`` into one row (``[1, S]`` tensors, module docstring); ``advantages[i]`` applies to
    every token of sample i that its ``loss_mask`` keeps (all response tokens when it has none).

    Built from whole-row lists and index tensors, not sample by sample: a step's hundreds of samples would each add
    small tensor operations, on the trainer's critical path."""
    for s in samples:
        _check_per_response_token(s)
    prompt_lens = torch.tensor([len(s.prompt.prompt_ids) for s in samples])
    resp_lens = torch.tensor([len(s.response_ids) for s in samples])
    lengths = prompt_lens + resp_lens
    total = int(lengths.sum())
    seq_len = -(-total // ROW_MULTIPLE) * ROW_MULTIPLE
    starts = lengths.cumsum(0) - lengths
    ids = chain.from_iterable(part for s in samples for part in (s.prompt.prompt_ids, s.response_ids))
    tokens = torch.full((1, seq_len), pad_token_id, dtype=torch.long)
    tokens[0, :total] = torch.tensor(list(ids), dtype=torch.long)
    position_ids = torch.empty(1, seq_len, dtype=torch.long)
    position_ids[0, :total] = _ranges(torch.zeros_like(lengths), lengths)
    last_start = total - int(lengths[-1])
    position_ids[0, total:] = torch.arange(total - last_start, seq_len - last_start)  # padding: the last sample's
    # prediction positions of the response tokens: response token j of a sample at offset o sits at o + P - 1 + j
    predicts = _ranges(starts + prompt_lens - 1, resp_lens)
    if all(s.loss_mask is None for s in samples):
        mask = torch.ones(len(predicts))
    else:
        masks = (s.loss_mask or [1.0] * len(s.response_ids) for s in samples)
        mask = torch.tensor(list(chain.from_iterable(masks)), dtype=torch.float32)
    loss_mask, adv, rollout_lp = (torch.zeros(1, seq_len - 1) for _ in range(3))
    loss_mask[0, predicts] = mask
    adv[0, predicts] = torch.tensor(advantages, dtype=torch.float32).repeat_interleave(resp_lens) * mask
    rollout_lp[0, predicts] = torch.tensor(list(chain.from_iterable(s.rollout_logprobs for s in samples))) * mask
    # The teacher engine's scores (prediction positions, as rollout_logprobs; 0 elsewhere), when it scored.
    teacher_lp = None
    if any(s.teacher_logprobs is not None for s in samples):
        if any(s.teacher_logprobs is None for s in samples):
            raise ValueError("Sample.teacher_logprobs: the teacher engine scores every sample of a step or none")
        teacher_lp = torch.zeros(1, seq_len - 1)
        teacher_lp[0, predicts] = torch.tensor(list(chain.from_iterable(s.teacher_logprobs or [] for s in samples)))
    return MicroBatch(
        tokens,
        position_ids,
        loss_mask,
        adv,
        rollout_lp,
        teacher_logprobs=teacher_lp,
        routed_experts=_packed_experts(samples, seq_len),
        kept_ids=_packed_kept_ids(samples, seq_len),
    )


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``cat([arange(start, start + count) for start, count in zip(starts, counts)])``, without the loop."""
    ends = counts.cumsum(0)
    return torch.arange(int(ends[-1]) if len(ends) else 0) + (starts - (ends - counts)).repeat_interleave(counts)


def _check_per_response_token(sample: Sample) -> None:
    """The per-response-token lists must match the response, or the packed row would shift them onto the next
    sample's positions."""
    expected = len(sample.response_ids)
    for name in ("rollout_logprobs", "loss_mask", "teacher_logprobs"):
        values = getattr(sample, name)
        if values is not None and len(values) != expected:
            raise ValueError(
                f"Sample.{name} has {len(values)} entries but the response has {expected} tokens "
                f"(prompt {sample.prompt.index}); it needs one per response token, see Sample"
            )


def _packed_kept_ids(samples: list[Sample], seq_len: int) -> torch.Tensor | None:
    """``MicroBatch.kept_ids`` of one packed row (prediction positions, as ``rollout_logprobs``), or None."""
    if all(s.kept_ids is None for s in samples):
        return None
    width = max(s.kept_ids.shape[1] for s in samples if s.kept_ids is not None)
    kept = torch.full((1, seq_len - 1, width), -1, dtype=torch.long)
    offset = 0
    for s in samples:
        if s.kept_ids is not None:
            if s.kept_ids.shape[0] != len(s.response_ids):
                raise ValueError(
                    f"Sample.kept_ids ({s.kept_ids.shape[0]} rows) must have one row per response token "
                    f"({len(s.response_ids)}) because the trainer replays them token by token; see Sample"
                )
            start = offset + len(s.prompt.prompt_ids) - 1
            kept[0, start : start + len(s.response_ids), : s.kept_ids.shape[1]] = s.kept_ids
        offset += s.total_length
    return kept


def _packed_experts(samples: list[Sample], seq_len: int) -> torch.Tensor | None:
    """``MicroBatch.routed_experts`` of one packed row: the samples' ids back to back, padding repeating
    the last token's; None unless every sample carries them."""
    if any(s.routed_experts is None for s in samples):
        return None
    for s in samples:
        if s.routed_experts.shape[0] != s.total_length:
            raise ValueError(
                f"Sample.routed_experts ({s.routed_experts.shape[0]} rows) must have one row per token "
                f"({s.total_length}) because the trainer replays them token by token; see Sample"
            )
    row = torch.cat([s.routed_experts for s in samples])
    padding = row[-1:].expand(seq_len - row.shape[0], *row.shape[1:])
    return torch.cat([row, padding])[None]


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
    """Group item indices into micro-batches whose total length fits ``max_tokens`` (first-fit
    decreasing: longest first, each into the first micro-batch with room).

    Packed rows carry no per-sample padding, so the budget is the sum of lengths; ``collate`` may add
    up to ``ROW_MULTIPLE - 1`` padding tokens. An item longer than the budget gets a micro-batch of its
    own rather than being dropped.
    """
    batches: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        target = next((b for b, load in enumerate(loads) if load + lengths[index] <= max_tokens), None)
        if target is None:
            batches.append([])
            loads.append(0)
            target = len(batches) - 1
        batches[target].append(index)
        loads[target] += lengths[index]
    return batches


def schedule_micro_batches(
    samples: list[Sample],
    advantages: list[float],
    dp_size: int,
    max_tokens: int,
    pad_token_id: int,
    one_sample_per_micro_batch: bool = False,
) -> list[list[MicroBatch]]:
    """Per DP rank, the micro-batches it trains on. Every rank gets at least one micro-batch
    (a loss-free copy when there are fewer samples than ranks) so all ranks join the gradient reduce.
    ``one_sample_per_micro_batch``: no packing (context parallelism splits one sequence per row)."""
    if not samples:
        raise ValueError("cannot schedule an empty batch: every group was filtered out")
    lengths = [s.total_length for s in samples]
    per_rank: list[list[MicroBatch]] = []
    for indices in balance_across_ranks(lengths, dp_size):
        if one_sample_per_micro_batch:
            packed = [[j] for j in range(len(indices))]
        else:
            packed = pack_micro_batches([lengths[i] for i in indices], max_tokens)
        per_rank.append(
            [
                collate([samples[indices[j]] for j in mb], [advantages[indices[j]] for j in mb], pad_token_id)
                for mb in packed
            ]
        )
    filler = next(mbs[0] for mbs in per_rank if mbs).without_loss()
    return [mbs if mbs else [filler] for mbs in per_rank]
