"""The embedded engine's record of which experts every MoE layer chose for every token it forwarded.

Rollout routing replay (R3, arXiv 2510.11370) needs the engine's expert choices so the trainer can
replay them. SGLang returns them as ``meta_info["routed_experts"]`` when asked with
``return_routed_experts=True`` (0.5.17 ``srt/state_capturer/routed_experts.py``, ``base.py get_topk``):
int32 ids of shape ``[seqlen - 1, num_layers, topk]``, base64 of the raw bytes (the last generated
token is never forwarded, so it has no routing). :func:`encode` / :func:`decode` are that encoding.

Recording: forward hooks on the HF model's routers (transformers 5 ``*TopKRouter`` modules, which
return ``(router_logits, router_weights, router_indices)``, indices ``[tokens, topk]``) copy the indices
into a buffer that :meth:`RouterRecorder.writing` points them at. The prefill writes a fresh
``[rows * width, layers, topk]`` tensor; a decode step writes each row's column ``step - 1`` (the token
it forwards) of the decode batch's static ``[rows, max_len, layers, topk]`` buffer through an index that
is a device tensor, so the copies are captured into the decode step's CUDA graph and replay with it.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rlrun.engine.types import RoutedExperts


class RouterContractError(ValueError):
    """A router from a transformers version whose routers do not choose their experts themselves."""


def _old_router(router: torch.nn.Module, what: str) -> str:
    import transformers

    return (
        f"{type(router).__name__} (transformers {transformers.__version__}) {what}, so the embedded engine "
        "cannot record its expert choices: it needs transformers' routers that return (logits, weights, "
        "indices), as DeepSeek-V3's and GLM-4 MoE's do in transformers 5.17 and not in 5.12.1; install a "
        "newer transformers"
    )


ROUTER_SUFFIX = "topkrouter"
"""transformers 5 names its MoE routers ``<Family>TopKRouter`` (Qwen3-MoE, Qwen2-MoE, Mixtral...) or
``<Family>TopkRouter`` (GLM-4.5 MoE, DeepSeek-V3); matched case-insensitively."""


class RouterRecorder:
    """Hooks on every router of one HF model, writing their top-k ids where :meth:`writing` says."""

    def __init__(self, routers: list[torch.nn.Module], top_k: int, num_experts: int) -> None:
        self.num_layers = len(routers)
        self.top_k = top_k
        self.dtype = torch.uint8 if num_experts <= 256 else torch.int32
        """Buffer dtype: one byte per id when it fits (Qwen3-30B-A3B, 128 experts: a 64-row x 8k-token
        decode buffer of 48 layers x top-8 is 200 MB instead of 800 MB); encoded as int32 regardless."""
        self._sink: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = None
        """Where the hooks write: (buffer, None) for a prefill, (buffer, (rows, columns)) for a decode step."""
        for layer, router in enumerate(routers):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RouterRecorder | None:
        """A recorder on ``model``'s routers (in layer order), or None for a dense model."""
        routers = [m for m in model.modules() if type(m).__name__.lower().endswith(ROUTER_SUFFIX)]
        if not routers:
            return None
        first: Any = routers[0]  # a transformers router: top_k and weight are plain attributes
        if not hasattr(first, "top_k"):
            raise RouterContractError(_old_router(first, "has no top_k"))
        return cls(routers, int(first.top_k), int(first.weight.shape[0]))

    def _hook(self, layer: int):
        def write(_module, _args, output) -> None:
            if self._sink is None:
                return
            buffer, at = self._sink
            if not (isinstance(output, tuple) and len(output) == 3):
                raise RouterContractError(_old_router(_module, "returns no (logits, weights, indices)"))
            indices = output[2].to(buffer.dtype)
            if at is None:  # prefill: [tokens, topk] for the whole [rows * width] block
                buffer[:, layer].copy_(indices)
            else:  # decode: one token per row, at each row's column of the token being forwarded
                buffer[at[0], at[1], layer] = indices

        return write

    def prefill_buffer(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_tokens, self.num_layers, self.top_k, dtype=self.dtype, device=device)

    def decode_buffer(self, num_rows: int, max_len: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(num_rows, max_len, self.num_layers, self.top_k, dtype=self.dtype, device=device)

    @contextlib.contextmanager
    def writing(self, buffer: torch.Tensor, step: torch.Tensor | None = None) -> Iterator[None]:
        """Route the hooks' writes into ``buffer``: the prefill's (``step`` None) or a decode batch's,
        at each row's column ``step - 1`` (``step``: the batch's [B] counters of the next token to sample;
        clamped so the capture's warm-up runs, before the batch is loaded, write in bounds)."""
        if step is None:
            self._sink = (buffer, None)
        else:  # the row index is built once per step, not once per layer
            rows = torch.arange(buffer.shape[0], device=buffer.device)
            self._sink = (buffer, (rows, (step - 1).clamp(min=0)))
        try:
            yield
        finally:
            self._sink = None


def encode(experts: torch.Tensor) -> RoutedExperts:
    """SGLang's wire form (base64 of the int32 bytes of ``[tokens, layers, topk]``) with its ``topk``."""
    data = base64.b64encode(experts.to(torch.int32).cpu().numpy().tobytes()).decode("ascii")
    return {"data": data, "topk": int(experts.shape[-1])}


def decode(routed: RoutedExperts, num_tokens: int) -> torch.Tensor:
    """``[num_tokens - 1, layers, topk]`` int32 from :func:`encode`'s (or SGLang's, wrapped) routing of a
    sample with ``num_tokens`` tokens (prompt + output)."""
    flat, top_k = np.frombuffer(base64.b64decode(routed["data"]), dtype=np.int32), routed["topk"]
    rows = max(num_tokens - 1, 0)
    if rows == 0 or flat.size % (rows * top_k):
        raise ValueError(
            f"routed_experts ({flat.size} ids) must hold (num_tokens - 1) x layers x topk ids "
            f"({rows} x ? x {top_k}) because SGLang returns one routing per forwarded token; "
            "check the engine and model.moe topk"
        )
    return torch.from_numpy(flat.copy()).reshape(rows, -1, top_k)
