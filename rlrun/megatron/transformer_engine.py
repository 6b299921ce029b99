"""Whether Megatron's TransformerEngine attention is importable: the one fact the attention spec and the MLA
layers both read (here, so neither imports the other)."""

from __future__ import annotations

import functools


@functools.cache
def transformer_engine_attention() -> type | None:
    """Megatron's TE core attention class, or None when TransformerEngine is not importable."""
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
    except ImportError:
        return None
    return TEDotProductAttention if HAVE_TE else None
