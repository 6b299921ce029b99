"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice ``[start, start + V_local)`` of the padded vocabulary. With
``z = logits / temperature`` and padded entries (ids >= the HF vocab size) excluded::

    m          = max_v z_v                                (all-reduce MAX; detached: the result
                                                           does not depend on it)
    S          = sum_v exp(z_v - m)                       (all-reduce SUM)
    log p(t)   = z_t - m - log S                          (z_t: all-reduce SUM of the owner's value)
    entropy    = m + log S - sum_v exp(z_v - m) z_v / S   (all-reduce SUM)

The sums are all-reduced over the TP group in the forward only: every TP rank computes the same loss,
so each rank's gradient is the local closed form (``rlrun.megatron.token_stats``, which also keeps the
fp32 work to one token chunk at a time). Padded entries are left out of the sums. Unlike
``tensor_parallel.vocab_parallel_cross_entropy`` the logits are not modified in place.
"""

from __future__ import annotations

import torch

from rlrun.megatron.model import MegatronModel
from rlrun.megatron.pipeline import last_stage_outputs
from rlrun.runtime.host_to_device import to_device


def vocab_parallel_token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    with_entropy: bool,
    kept_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) for local logits ``[B, S, V_local]`` (or ``[S, V_local]``) and
    ``targets`` of the leading shape; chunked over tokens with a closed-form backward
    (``rlrun.megatron.token_stats``), so no fp32 copy of the logits outlives a chunk.

    ``kept_ids`` (``MicroBatch.kept_ids``, top-p mask replay): where a position has a kept set, its log-prob is
    renormalised over that set (``kept_set_logprobs``); the entropy stays the full distribution's."""
    from megatron.core import parallel_state as mpu

    from rlrun.megatron.token_stats import chunked_token_stats, kept_set_logprobs

    start = mpu.get_tensor_model_parallel_rank() * logits.shape[-1]
    group = mpu.get_tensor_model_parallel_group()
    logprobs, entropy = chunked_token_stats(logits, targets, temperature, start, vocab_size, group)
    if kept_ids is not None:
        kept_ids = kept_ids.to(logits.device)
        renormalised = kept_set_logprobs(logits, targets, kept_ids, temperature, start, vocab_size, group)
        logprobs = torch.where(kept_ids[..., 0] >= 0, renormalised, logprobs)
    return logprobs, entropy if with_entropy else None


def head_token_stats(
    model: MegatronModel,
    output: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    kept_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vocab_parallel_token_stats` of the model's last-stage ``output`` (``forward_logits`` of the
    positions that predict ``targets``): logits, or with a deferred LM head (``model.lm_head: chunked``)
    hidden states, projected chunk by chunk so that no ``[T, V]`` tensor exists. Top-p mask replay
    (``kept_ids``) gathers arbitrary logits, so there the projection is materialised as Megatron's output
    layer would (same numbers, not the memory saving)."""
    if not model.deferred_head:
        return vocab_parallel_token_stats(output, targets, temperature, model.arch.vocab_size, with_entropy, kept_ids)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    from rlrun.megatron.lm_head import output_weight
    from rlrun.megatron.token_stats import chunked_head_token_stats

    weight = output_weight(model.module)
    if kept_ids is not None:
        logits = copy_to_tensor_model_parallel_region(output) @ weight.t()  # the output layer's TP contract
        return vocab_parallel_token_stats(logits, targets, temperature, model.arch.vocab_size, with_entropy, kept_ids)
    start = mpu.get_tensor_model_parallel_rank() * weight.shape[0]
    group = mpu.get_tensor_model_parallel_group()
    logprobs, entropy = chunked_head_token_stats(
        output, weight, targets, temperature, start, model.arch.vocab_size, group, model.keeps_head_logits
    )
    return logprobs, entropy if with_entropy else None


def model_token_stats(
    model: MegatronModel,
    output: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    kept_ids: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(tokens[:, 1:]), entropy or None), each ``[B, S-1]``, from :func:`forward_logits`' ``output`` of
    ``tokens``. With context parallelism the output covers this CP rank's positions only: the targets are cut
    the same way and the stats gathered back to the whole row (rlrun/megatron/context_parallel.py).

    ``scored`` (``[B, S-1]``, on the host; the train step passes the loss mask): with a deferred LM head, only its
    nonzero positions are projected and scored, and the others read 0 (:func:`_scored_positions`)."""
    if model.parallel.cp_size == 1 and scored is not None and model.deferred_head and kept_ids is None:
        return _scored_positions(model, output, tokens, scored, temperature, with_entropy)
    targets = to_device(tokens[:, 1:], output.device)
    if model.parallel.cp_size == 1:
        return head_token_stats(model, output[:, :-1], targets, temperature, with_entropy, kept_ids)
    from rlrun.megatron import context_parallel

    # position p predicts token p + 1; the row's last position predicts nothing (a dummy target, dropped)
    aligned = torch.nn.functional.pad(targets, (0, 1))
    kept = (
        None if kept_ids is None else context_parallel.shard(torch.nn.functional.pad(kept_ids, (0, 0, 0, 1), value=-1))
    )
    logprobs, entropy = head_token_stats(
        model, output, context_parallel.shard(aligned), temperature, with_entropy, kept
    )
    length = targets.shape[1]
    whole = context_parallel.gather_positions(logprobs, length)
    return whole, None if entropy is None else context_parallel.gather_positions(entropy, length)


def _scored_positions(
    model: MegatronModel,
    output: torch.Tensor,
    tokens: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`model_token_stats` of the positions where ``scored`` is nonzero, zero elsewhere.

    The train step's loss reads log-probs and entropies under its loss mask only, and a GRPO row's prompt is often
    a fifth or more of it: the LM head is ~1/5 of a Qwen3-1.7B step's matmul FLOPs (its 152K-id projection, three
    GEMMs and the chunked head's recompute), so projecting the prompt positions is pure waste. Their final hidden
    states are gathered into ``[N, H]`` (indices found on the host, so no device sync), scored as one row, and the
    results put back in place; the gather's backward scatters the hidden states' gradient back."""
    hidden = output.reshape(-1, output.shape[-1])  # [B * S, H]; position (b, s) predicts token (b, s + 1)
    rows, length = tokens.shape
    if tuple(scored.shape) != (rows, length - 1):
        raise ValueError(
            f"the micro-batch's loss_mask must be [rows, tokens - 1] = {[rows, length - 1]} for tokens of shape "
            f"{list(tokens.shape)}, because position p scores token p + 1; got {list(scored.shape)}"
        )
    flat = scored.cpu().reshape(-1).nonzero().squeeze(1)  # into [B * (S-1)]
    picked = flat + flat // (length - 1)  # the same positions in [B * S]: one more a row before
    targets = tokens.cpu()[:, 1:].reshape(-1)[flat]
    device = output.device
    logprobs, entropy = head_token_stats(
        model, hidden.index_select(0, to_device(picked, device)), to_device(targets, device), temperature, with_entropy
    )
    where = to_device(flat, device)

    def in_place(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(rows * (length - 1)).index_copy(0, where, values).view(rows, length - 1)

    return in_place(logprobs), None if entropy is None else in_place(entropy)


def forward_logits(model: MegatronModel, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The model's local vocab-parallel logits ``[B, S, V_local]``, or its final hidden states ``[B, S, H]``
    with a deferred LM head (``MegatronModel.deferred_head``; :func:`head_token_stats` takes either), on a
    stage before the last with PP > 1 its output hidden states; inputs may live on the CPU.

    Rows whose ``position_ids`` are ``0..S-1`` are single causal sequences. Rows whose positions
    restart at 0 hold several packed samples (``rlrun.data.batch.collate``): the rows are flattened
    into Megatron's ``thd`` layout, where attention stays inside each sample and RoPE positions restart
    with it (``rlrun.megatron.attention.packed_seq_params``), and the logits come back as ``[B, S, V_local]``.
    """
    from rlrun.megatron.attention import packed_seq_params

    device = model.parallel.device
    packing = packed_seq_params(position_ids, device)
    tokens, position_ids = to_device(tokens, device), to_device(position_ids, device)
    if model.parallel.cp_size > 1:
        from rlrun.megatron import context_parallel

        if packing is not None:
            raise ValueError(
                f"parallel.cp ({model.parallel.cp_size}) needs micro-batches of one sample per row because each CP "
                "rank holds chunks of one sequence; these rows are packed (position_ids restart)"
            )
        tokens, position_ids = context_parallel.shard(tokens), context_parallel.shard(position_ids)
    if packing is None:
        return model.ddp(input_ids=tokens, position_ids=position_ids, attention_mask=None)
    output = model.ddp(
        input_ids=tokens.reshape(1, -1),
        position_ids=position_ids.reshape(1, -1),
        attention_mask=None,
        packed_seq_params=packing,
    )
    if not model.parallel.is_last_stage:  # thd hidden states [T, 1, H] go to the next stage as they are
        return output
    return output.reshape(*tokens.shape, output.shape[-1])


def compute_logprobs(
    model: MegatronModel,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    kept_ids: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log p(tokens[:, 1:] | prefix)`` as ``[B, S-1]`` float32 on the model's device, logits divided
    by ``temperature``, on every rank (with PP > 1, computed on the last stage and broadcast); renormalised
    over ``kept_ids`` where given (top-p mask replay, ``vocab_parallel_token_stats``); only where ``scored``
    (``[B, S-1]``, on the host) is nonzero, 0 elsewhere, when given (:func:`model_token_stats`).

    Differentiable at PP=1; wrap in ``torch.no_grad()`` for forward-only passes (old, reference log-probs).
    """
    (logprobs,) = _token_stats(model, tokens, position_ids, temperature, False, kept_ids, scored)
    return logprobs


def compute_logprobs_and_entropy(
    model: MegatronModel, tokens: torch.Tensor, position_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_logprobs`` plus the entropy ``[B, S-1]`` of each predictive distribution."""
    logprobs, entropy = _token_stats(model, tokens, position_ids, temperature, with_entropy=True)
    return logprobs, entropy


def _token_stats(
    model: MegatronModel,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    kept_ids: torch.Tensor | None = None,
    scored: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """[log-probs] or [log-probs, entropy] of ``tokens`` on every rank of the pipeline."""

    def head(output: torch.Tensor) -> list[torch.Tensor]:
        stats = model_token_stats(model, output, tokens, temperature, with_entropy, kept_ids, scored)
        return [t for t in stats if t is not None]

    return last_stage_outputs(
        model, tokens, lambda: forward_logits(model, tokens, position_ids), head, count=2 if with_entropy else 1
    )
