"""Wire types of the engine RPC (docs/engine-contract.md, "Methods").

They are ``TypedDict``s rather than dataclasses because they cross a msgpack boundary as plain maps
and must stay field-for-field identical to the contract that the SGLang worker also serves; the
types document the fields and let a type checker hold callers to them.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from typing_extensions import NotRequired

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's memory tags; ``None`` in release/resume means all of them."""

DEFAULT_WEIGHT_VERSION = "default"
"""SGLang's ``weight_version`` before the first update (ServerArgs default)."""


class FinishReason(TypedDict):
    """Why a response ended, in SGLang's shape.

    ``stop`` carries ``matched``: the EOS or stop token id (the last entry of ``output_ids``) or the
    stop string (completed by the last tokens of ``output_ids``, which are kept); ``length`` carries
    ``length`` (= max_new_tokens); ``abort`` carries ``message`` (the output so far is returned).
    """

    type: Literal["stop", "length", "abort"]
    matched: NotRequired[int | str]
    length: NotRequired[int]
    message: NotRequired[str]


class RoutedExperts(TypedDict):
    """``data``: SGLang's ``meta_info["routed_experts"]``, base64 of int32 expert ids of shape
    ``[prompt_tokens + completion_tokens - 1, layers, topk]``; ``topk`` (which SGLang leaves to the
    caller's model config) makes it self-describing. ``rlrun.engine.embedded.routing_record.decode``."""

    data: str
    topk: int


class KeptIds(TypedDict):
    """A response's kept sets (top-p mask replay, ``rlrun.engine.kept_set``): the bytes of ``[tokens, width]`` int32."""

    data: bytes
    width: int


class GenResult(TypedDict):
    """One sampled response. ``output_logprobs[i]`` is log_softmax(logits / T) of ``output_ids[i]`` in fp32,
    taken before top-p/top-k filtering (SGLang), or, when the result has ``kept_ids`` (the embedded engine on
    a filtering row), renormalised over the kept set it was drawn from; None when the caller did not ask."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    routed_experts: NotRequired[RoutedExperts]
    """MoE models, when recorded (rollout routing replay): the experts every MoE layer chose for every
    forwarded token (the last output token is never forwarded)."""
    kept_ids: NotRequired[KeptIds]
    """Filtering rows of the embedded engine (top-p mask replay): each output token's kept set."""
    cached_tokens: NotRequired[int]
    """Rows that name a ``session`` (embedded engine): the prompt's leading tokens whose K/V came from the session's
    previous call instead of a prefill (SGLang's ``cached_tokens``)."""


class OpResult(TypedDict):
    """SGLang's ``(success, message)`` pair for weight updates and cache flushes."""

    success: bool
    message: str


class EngineStatus(TypedDict):
    """What ``health`` reports. ``num_inflight`` counts generate requests being served."""

    state: Literal["starting", "ready", "paused", "dead"]
    released_tags: list[str]
    in_update_session: bool
    num_inflight: int
    weight_version: str
