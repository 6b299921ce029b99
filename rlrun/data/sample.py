"""The unit of rollout data: one prompt's response, with what the engine and the reward said of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Prompt:
    """One dataset row, tokenized.

    ``index`` is the row's position in the file (stable across shuffles), used to name groups.
    """

    index: int
    prompt_ids: list[int]
    prompt_text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None
    """Tool schemas of the row (``data.tools_key``), already rendered into the prompt by the chat
    template; generate hooks read them to know which tools exist."""


TENSOR_FIELDS = ("routed_experts", "kept_ids")
""":class:`Sample`'s int32 tensor fields: nested lists in a saved rollout's JSON, tensors again when loaded."""


def _int32_tensor(value) -> torch.Tensor:
    import torch

    return torch.as_tensor(value, dtype=torch.int32)


@dataclass
class Sample:
    """One response to a prompt.

    Invariants: ``len(rollout_logprobs) == len(response_ids)``, and ``len(loss_mask) ==
    len(response_ids)`` when there is a mask; samples of one group share ``group_index`` and
    ``prompt_ids`` and travel together (never split across DP ranks' steps).
    """

    group_index: int
    prompt: Prompt
    response_ids: list[int]
    response_text: str
    rollout_logprobs: list[float]
    finish_reason: str
    """"stop" (ended on EOS or a stop token), "length" (hit max_new_tokens) or "abort"."""
    weight_version: str = ""
    reward: float = 0.0
    reward_error: str | None = None
    """The reward function's exception message when it raised (the reward is then 0)."""
    reward_components: dict[str, float] | None = None
    """A dict reward's named scores (``reward`` is the one under ``rollout.reward_key``); None for a float reward."""
    loss_mask: list[int] | None = None
    """Per response token: 1 if the model generated it (trained on), 0 if it was inserted by a tool
    or the environment in a multi-turn rollout (context only: no loss, and its ``rollout_logprobs``
    entry is 0). None means every response token is the model's (single-turn generation)."""
    routed_experts: torch.Tensor | None = None
    """MoE rollouts: ``[total_length, moe_layers, topk]`` int32 expert ids the engine chose for each token
    (rollout routing replay). The engine returns ``total_length - 1`` of them (the last token is never
    forwarded); the last token's row repeats the one before it, as slime pads it: that token's output
    predicts nothing in the loss, and a valid distinct top-k keeps the trainer's dispatch well formed.
    None: not recorded (dense model, or a multi-turn ``generate_fn``)."""

    kept_ids: torch.Tensor | None = None
    """Top-p mask replay: ``[len(response_ids), width]`` int32, each response token's kept set (the ids the
    engine's top-p / top-k / min-p filter kept when it drew that token, -1 padded); ``rollout_logprobs`` are
    then renormalised over it, and so are the trainer's. None: sampled without a filter (or by SGLang)."""
    teacher_logprobs: list[float] | None = None
    """``algorithm.opd.teacher_engine``: the teacher engine's log-prob of each response token (None: no
    teacher engine; the trainer-side teacher fills the micro-batch instead)."""
    carried_tokens: int = 0
    """Response tokens generated before the sample was continued from prompt + those tokens: in earlier steps
    (partial rollout: aborted at a batch boundary), or before a weight update (``rollout.continue_after_tokens``:
    cut at the token boundary); 0 for a sample generated in one call."""
    weight_spans: list[tuple[str, int]] | None = None
    """``(weight_version, num_tokens)`` runs over the response, oldest first, when its tokens came from more
    than one generate call (partial rollout, ``rollout.continue_after_tokens``); None: every token is
    ``weight_version``'s."""
    parts: list[Sample] | None = None
    """A trajectory that yields several training samples (a ``generate_fn`` returned a list): those samples,
    in order; this sample is a copy of the last one. The reward, the dynamic filter and the group statistics
    see the trajectory (this sample) once; each part trains as its own sample with the trajectory's group
    score (rlrun/rollout/train_samples.py). None: the sample is its own training sample."""

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Sample:
        """The inverse of ``dataclasses.asdict`` (a checkpoint's carried groups, a saved rollout's JSON lines):
        the prompt and parts as objects again, weight spans as tuples, the tensor fields as int32 tensors."""
        spans, parts = row.get("weight_spans"), row.get("parts")
        tensors = {name: _int32_tensor(row[name]) for name in TENSOR_FIELDS if row.get(name) is not None}
        return cls(
            **{
                **row,
                **tensors,
                "prompt": Prompt(**row["prompt"]),
                "weight_spans": [(v, n) for v, n in spans] if spans else None,
                "parts": [cls.from_dict(part) for part in parts] if parts else None,
            }
        )

    @property
    def first_weight_version(self) -> str:
        """The weight version that generated the response's first token."""
        return self.weight_spans[0][0] if self.weight_spans else self.weight_version

    @property
    def num_loss_tokens(self) -> int:
        """Response tokens the loss covers (the denominator of a token-mean loss)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    @property
    def total_length(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.response_ids)
