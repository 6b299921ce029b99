"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice ``[start, start + V_local)`` of the padded vocabulary. With
``z = logits / temperature`` and padded entries (ids >= the HF vocab size) excluded::

    m          = max_v z_v                                (all-reduce MAX; detached: the result
                                                           does not depend on it)
    S          = sum_v exp(z_v - m)                       (all-reduce SUM)
    log p(t)   = z_t - m - log S                          (z_t: all-reduce SUM of the owner's value)
    entropy    = m + log S - sum_v exp(z_v - m) z_v / S   (all-reduce SUM)

The sums go through Megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward,
identity backward), which is the correct gradient because every TP rank computes the same loss.
Padded entries are zeroed in the sums instead of set to -inf, so no ``0 * inf = nan`` reaches the
gradient. Unlike ``tensor_parallel.vocab_parallel_cross_entropy`` nothing is modified in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlrun.megatron.model import MegatronModel


def vocab_parallel_token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) for local logits ``[..., V_local]`` and ``targets [...]``."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum

    local_vocab = logits.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * local_vocab
    z = logits.float() / temperature
    padded = torch.arange(start, start + local_vocab, device=z.device) >= vocab_size
    with torch.no_grad():
        m = z.masked_fill(padded, float("-inf")).amax(dim=-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    exp = torch.exp(z - m.unsqueeze(-1)).masked_fill(padded, 0.0)
    sum_exp = tp_sum(exp.sum(dim=-1))
    local_targets = targets - start
    owned = (local_targets >= 0) & (local_targets < local_vocab)
    picked = z.gather(-1, local_targets.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    log_normalizer = m + torch.log(sum_exp)
    logprobs = tp_sum(picked * owned) - log_normalizer
    if not with_entropy:
        return logprobs, None
    entropy = log_normalizer - tp_sum((exp * z).sum(dim=-1)) / sum_exp
    return logprobs, entropy


def forward_logits(model: MegatronModel, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The model's local vocab-parallel logits ``[B, S, V_local]``; inputs may live on the CPU.

    Rows whose ``position_ids`` are ``0..S-1`` are single causal sequences. Rows whose positions
    restart at 0 hold several packed samples (``rlrun.data.batch.collate``): the rows are flattened
    into Megatron's ``thd`` layout, where attention stays inside each sample and RoPE positions restart
    with it (``rlrun.megatron.attention.packed_seq_params``), and the logits come back as ``[B, S, V_local]``.
    """
    from rlrun.megatron.attention import packed_seq_params

    device = model.parallel.device
    packing = packed_seq_params(position_ids, device)
    tokens, position_ids = tokens.to(device), position_ids.to(device)
    if packing is None:
        return model.ddp(input_ids=tokens, position_ids=position_ids, attention_mask=None)
    logits = model.ddp(input_ids=tokens.reshape(1, -1), position_ids=position_ids.reshape(1, -1),
                       attention_mask=None, packed_seq_params=packing)
    return logits.reshape(*tokens.shape, logits.shape[-1])


def compute_logprobs(model: MegatronModel, tokens: torch.Tensor, position_ids: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """``log p(tokens[:, 1:] | prefix)`` as ``[B, S-1]`` float32 on the model's device, logits divided
    by ``temperature``.

    Differentiable; wrap in ``torch.no_grad()`` for forward-only passes (old, reference log-probs).
    """
    logits = forward_logits(model, tokens, position_ids)
    logprobs, _ = vocab_parallel_token_stats(logits[:, :-1], tokens[:, 1:].to(logits.device), temperature,
                                             model.arch.vocab_size, with_entropy=False)
    return logprobs


def compute_logprobs_and_entropy(model: MegatronModel, tokens: torch.Tensor, position_ids: torch.Tensor,
                                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_logprobs`` plus the entropy ``[B, S-1]`` of each predictive distribution."""
    logits = forward_logits(model, tokens, position_ids)
    logprobs, entropy = vocab_parallel_token_stats(logits[:, :-1], tokens[:, 1:].to(logits.device),
                                                   temperature, model.arch.vocab_size, with_entropy=True)
    return logprobs, entropy
