"""The wire form of top-p mask replay's kept sets (what the embedded engine returns as ``GenResult.kept_ids``).

With ``top_p < 1`` (or top-k, min-p) a token is drawn from the model's distribution renormalised over the
tokens the filter kept. The engine reports that token's log-prob under the renormalised distribution and
the kept set itself, and the trainer renormalises its own log-probs over the same set
(``rlrun.megatron.token_stats.kept_set_logprobs``): the ratio and the gradient are then for the policy that
sampled (slime PR #2102; DeepSeek-V3.2's "keep sampling mask"; vLLM's sampling-mask replay).

A response's kept sets are one ``[tokens, width]`` int32 matrix, each row the kept ids (most likely first)
padded with -1, ``width`` the largest set of the response; on the wire: base64 of its bytes with ``width``.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from rlrun.engine.types import KeptIds


def encode_kept_ids(kept: torch.Tensor) -> KeptIds:
    """``[tokens, W]`` (-1 padded) -> the wire form, trimmed to the widest set of the response."""
    width = max(int((kept >= 0).sum(-1).max()) if kept.numel() else 1, 1)
    data = base64.b64encode(kept[:, :width].to(torch.int32).cpu().numpy().tobytes()).decode("ascii")
    return {"data": data, "width": width}


def decode_kept_ids(kept: KeptIds, num_tokens: int) -> torch.Tensor:
    """The ``[num_tokens, width]`` int32 matrix of :func:`encode_kept_ids`, for a response of ``num_tokens``."""
    flat = np.frombuffer(base64.b64decode(kept["data"]), dtype=np.int32)
    if flat.size != num_tokens * kept["width"]:
        raise ValueError(
            f"kept_ids ({flat.size} ids) must hold output tokens x width ({num_tokens} x {kept['width']}) "
            "because the engine returns one kept set per output token; check the engine"
        )
    return torch.from_numpy(flat.copy()).reshape(num_tokens, kept["width"])
