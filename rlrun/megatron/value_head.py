"""The PPO critic as a Megatron model: the actor's ``GPTModel`` trunk with a scalar value head.

The trunk (embeddings, decoder layers, final norm) is built and loaded exactly like the actor's
(``rlrun.megatron.model``); then the language-model head is replaced by :class:`ValueHead`, a
``[hidden] -> 1`` linear that every TP rank holds whole. Replicating it needs no collective: after the
final norm the hidden states are the same on every TP rank (no sequence parallelism), so every TP rank
computes the same values, the same loss and the same head gradient, and the trunk's backward is the
usual one (its RowParallel outputs were all-reduced in forward, identity in backward). Megatron's
grad-norm counts a parameter without ``tensor_model_parallel`` on TP rank 0 only, so it is counted once.

The head starts from the HF directory's ``score.weight`` / ``score.bias`` when present (HF's
``*ForSequenceClassification`` / ``*ForTokenClassification`` with one label, i.e. a reward or value
model), otherwise fresh: normal(0, 1 / (hidden + 1)) weights (OpenRLHF's value-head init) and a zero bias,
seeded identically on every rank so DP replicas start equal. The values then start near 0 (std
``|h| / (hidden + 1)``: 0.08 on SmolLM2-135M's final hidden states, norm ~48) and the first GAE advantages
are close to the returns. Megatron's output-layer init, normal(0, ``init_method_std`` = 0.02), gave values
of std 0.95 there, varying by ~1 from one position to the next: the first steps' advantages were that
noise rather than the rewards (0 or ~1, rare), and the PPO quickstart's actor barely moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from rlrun.megatron.hf_weights import HFCheckpoint
from rlrun.megatron.logprobs import forward_logits
from rlrun.megatron.model import MegatronModel, build_gpt, wrap_ddp
from rlrun.megatron.pipeline import last_stage_outputs
from rlrun.megatron.train import optimizer_step
from rlrun.runtime.dist import Parallel

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

HF_HEAD_NAMES = ("score.weight", "score.bias")
ValueLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro_batch, values [B, S-1] float32) -> (loss summed over loss-masked tokens, {metric: summed tensor})."""


class ValueHead(torch.nn.Module):
    """``values = hidden @ w + b``, called where GPTModel calls its output layer (same signature)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1, bias=True, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return self.linear(hidden_states), None


def build_critic_model(
    hf_dir: str,
    parallel: Parallel,
    dtype: str,
    seed: int,
    packed_attention: str = "auto",
    grad_buffer_region: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> MegatronModel:
    """The critic of ``hf_dir`` on this rank (TP shards of the trunk, the whole head), in Megatron DDP (gradient
    buffers allocated in ``grad_buffer_region``, as ``build_model``'s)."""
    # the actor's trunk (its LM head is dropped)
    gpt, arch, config = build_gpt(hf_dir, parallel, dtype, packed_attention=packed_attention)
    # Every stage drops the tie, so no stage all-reduces embedding gradients with a head that is gone.
    gpt.share_embeddings_and_output_weights = False
    if parallel.is_last_stage:
        gpt.output_layer = ValueHead(arch.hidden_size, config.params_dtype, parallel.device)
        init_value_head(gpt.output_layer, HFCheckpoint(hf_dir), 1.0 / (arch.hidden_size + 1), seed)
    return wrap_ddp(gpt, arch, config, parallel, dtype, grad_buffer_region=grad_buffer_region)


@torch.no_grad()
def init_value_head(head: ValueHead, checkpoint: HFCheckpoint, std: float, seed: int) -> None:
    """Load ``score.*`` from the HF checkpoint when it has them, else a fresh seeded init."""
    weight, bias = head.linear.weight, head.linear.bias
    if HF_HEAD_NAMES[0] in checkpoint.names():
        loaded = checkpoint.get(HF_HEAD_NAMES[0])
        if tuple(loaded.shape) != tuple(weight.shape):
            raise ValueError(
                f"{checkpoint.hf_dir}: score.weight ({tuple(loaded.shape)}) must have shape "
                f"{tuple(weight.shape)} because it is the critic's scalar value head; use a one-label "
                f"value model or remove score.* to start the head fresh"
            )
        weight.copy_(loaded)
        bias.copy_(checkpoint.get(HF_HEAD_NAMES[1]) if HF_HEAD_NAMES[1] in checkpoint.names() else torch.zeros(1))
        return
    generator = torch.Generator().manual_seed(seed)
    weight.copy_(torch.randn(weight.shape, generator=generator) * std)
    bias.zero_()


def compute_values(model: MegatronModel, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S-1]`` float32 values: position ``t`` is the value of the prefix ``tokens[:, :t+1]``, the state
    in which ``tokens[:, t+1]`` is generated (the layout of log-probs and advantages). On every rank: with
    PP > 1 the last stage computes them and broadcasts them."""
    (values,) = last_stage_outputs(
        model,
        tokens,
        lambda: forward_logits(model, tokens, position_ids),
        lambda out: [out[:, :-1, 0].float()],
        count=1,
    )
    return values


def value_train_step(
    model: MegatronModel,
    optimizer: MegatronOptimizer,
    micro_batches: Sequence,
    loss_fn: ValueLossFn,
    num_global_tokens: int,
) -> dict[str, float]:
    """One optimizer step of the critic, on the actor's schedule (``rlrun.megatron.train.optimizer_step``):
    ``loss`` is the DP-summed loss / ``num_global_tokens``, ``grad_norm`` is before clipping."""
    return optimizer_step(
        model, optimizer, micro_batches, lambda mb, out: loss_fn(mb, out[:, :-1, 0].float()), num_global_tokens
    )
