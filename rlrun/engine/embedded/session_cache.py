"""A session's K/V kept across generate calls, so an agent's next turn prefills only its new tokens.

A generate call whose sampling params name a ``session`` (one sample, ``n == 1``) leaves that session's K/V
here when its row ends: the prompt's and every output token's but the last (the last token is sampled, never
forwarded). The session's next call whose prompt extends those tokens exactly copies them into its prefill
cache and forwards only the suffix (:meth:`EmbeddedEngine._prefill`); a prompt that does not extend them drops
them. Everything kept is dropped when the weights change or the engine releases its memory, and the least
recently used session goes when more than ``max_sessions`` are kept.

The suffix's attention sums run over another query length than a whole-prompt prefill's, and the kept response
K/V come from decode steps, so the logits are not bitwise those of a prefill from the first token wherever the
kernels round by the call's shape (SDPA on CPU): off unless ``session_cache_size`` is set (docs/engine.md).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class KeptSession:
    """The tokens whose K/V are kept (cache columns 0 to ``len(tokens) - 1``) and per layer their
    ``[kv_heads, len(tokens), head_dim]`` keys and values."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class SessionCache:
    """Up to ``max_sessions`` sessions' K/V by session id (0: nothing is kept), least recently used dropped first,
    and the prompt tokens prefilled and taken from here so far."""

    def __init__(self, max_sessions: int = 0) -> None:
        if not isinstance(max_sessions, int) or isinstance(max_sessions, bool) or max_sessions < 0:
            raise ValueError(
                f"session_cache_size ({max_sessions!r}) must be an integer >= 0 because it counts the sessions "
                "whose K/V are kept (0: none); fix engine.server_args.session_cache_size"
            )
        self.max_sessions = max_sessions
        self._kept: collections.OrderedDict[str, KeptSession] = collections.OrderedDict()
        self.prefill_tokens = 0
        """Prompt tokens forwarded by prefills (padding not counted), since the engine started."""
        self.reused_tokens = 0
        """Prompt tokens whose K/V were copied from here instead."""

    @property
    def enabled(self) -> bool:
        return self.max_sessions > 0

    def __len__(self) -> int:
        return len(self._kept)

    def prefix(self, session: str | None, prompt: list[int]) -> KeptSession | None:
        """The session's kept K/V if ``prompt`` extends its tokens exactly; otherwise None, and the session's K/V
        (if any) are dropped: its conversation went another way."""
        if session is None or not self.enabled:
            return None
        kept = self._kept.pop(session, None)
        if kept is None or len(kept.tokens) > len(prompt) or prompt[: len(kept.tokens)] != kept.tokens:
            return None
        self._kept[session] = kept  # most recently used; popped again when the call's row ends
        return kept

    def keep(self, session: str, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep ``tokens``' K/V for the session (replacing what it had), dropping the least recently used beyond
        the bound."""
        if not self.enabled:
            return
        self._kept.pop(session, None)
        self._kept[session] = KeptSession(tokens, keys, values)
        while len(self._kept) > self.max_sessions:
            self._kept.popitem(last=False)

    def drop(self, session: str) -> None:
        self._kept.pop(session, None)

    def clear(self) -> None:
        """Drop every session's K/V (weights changed, memory released, rollout over)."""
        self._kept.clear()


def reusable_columns(prompts: list[list[int]], kept: Sequence[KeptSession | None] = ()) -> int:
    """The leading cache columns a prefill of ``prompts`` copies from their ``kept`` sessions instead of forwarding:
    0 unless every prompt has kept K/V, else the fewest kept tokens, but leaving each prompt's last token and at
    least two columns to forward (a prompt's first logits come from its last position; a one-column forward
    would be read as a decode step, whose mask must be a prefix of the columns)."""
    if not kept or any(k is None for k in kept):
        return 0
    shortest = min(len(k.tokens) for k in kept if k is not None)
    return max(0, min(shortest, min(len(p) for p in prompts) - 1, max(len(p) for p in prompts) - 2))
