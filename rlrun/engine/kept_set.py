"""The wire form of top-p mask replay's kept sets (what the embedded engine returns as ``GenResult.kept_ids``).

With ``top_p < 1`` (or top-k, min-p) a token is drawn from the model's distribution renormalised over the
tokens the filter kept. The engine reports that token's log-prob under the renormalised distribution and
the kept set itself, and the trainer renormalises its own log-probs over the same set
(``rlrun.megatron.token_stats.kept_set_logprobs``): the ratio and the gradient are then for the policy that
sampled (slime's and DeepSeek-V3.2's "keep sampling mask"; vLLM's sampling-mask replay).

A response's kept sets are one ``[tokens, width]`` int32 matrix, each row the kept ids (most likely first)
padded with -1, ``width`` the largest set of the response; on the wire: its bytes (msgpack carries them as binary)
with ``width``. Why bytes, not base64 text: a sampled call's kept sets can be tens of MB of ids (a random model keeps
hundreds of tokens a draw), and base64 makes them a third larger, to encode, pack, validate as UTF-8 on unpacking and
decode again in the rollout driver (``benchmarks/kept_set_wire.py``; BENCHMARKS.md, "Decode attention: fast and exact").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlrun.engine.types import KeptIds


def encode_kept_rows(kept: torch.Tensor, lengths: Sequence[int]) -> list[KeptIds]:
    """Row k's kept sets ``kept[k, :lengths[k]]`` (``[rows, tokens, W]``, -1 padded, on any device) in the wire form,
    each trimmed to its response's widest set, from one copy to the host (not one copy and one sync a row)."""
    host = kept[:, : max(lengths, default=0)].to(torch.int32).cpu().numpy()
    return [_wire(host[k, :n]) for k, n in enumerate(lengths)]


def _wire(kept: np.ndarray) -> KeptIds:
    width = max(int((kept >= 0).sum(-1).max()) if kept.size else 1, 1)
    return {"data": np.ascontiguousarray(kept[:, :width]).tobytes(), "width": width}


def decode_kept_ids(kept: KeptIds, num_tokens: int) -> torch.Tensor:
    """The ``[num_tokens, width]`` int32 matrix of :func:`encode_kept_rows`, for a response of ``num_tokens``."""
    flat = np.frombuffer(kept["data"], dtype=np.int32)
    if flat.size != num_tokens * kept["width"]:
        raise ValueError(
            f"kept_ids ({flat.size} ids) must hold output tokens x width ({num_tokens} x {kept['width']}) "
            "because the engine returns one kept set per output token; check the engine"
        )
    return torch.from_numpy(flat.copy()).reshape(num_tokens, kept["width"])
