"""``model.lm_head: chunked``: the last stage returns hidden states and the log-prob code applies the LM head.

Megatron's output layer turns the final hidden states ``[T, H]`` into logits ``[T, V_local]`` that the
backward keeps: 9.3 GB of bf16 at 32K tokens of Qwen3's 152K vocabulary, plus GPTModel's transposed copy,
the largest single allocation of a long-response step. With the head deferred, the output layer keeps its
parameters (names, sharding, checkpoints, the tied-embedding sync are unchanged) but its forward passes the
hidden states through; ``rlrun.megatron.logprobs.head_token_stats`` projects them chunk by chunk
(``rlrun.megatron.token_stats.chunked_head_token_stats``), so no ``[T, V]`` tensor is ever alive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


def _hidden_states(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
    """The output layer's ``(output, bias)`` contract with the hidden states as the output."""
    return input_, None


def defer_output_layer(gpt: GPTModel) -> None:
    """Make ``gpt`` (a last pipeline stage) return its final hidden states ``[B, S, H]`` instead of logits."""
    gpt.output_layer.forward = _hidden_states


def output_weight(gpt: GPTModel) -> torch.Tensor:
    """This TP rank's vocabulary slice of the LM head ``[V_local, H]``: the word embedding when tied and this
    stage holds it, else the output layer's own (on a last stage after the first, Megatron's tied copy)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
