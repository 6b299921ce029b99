"""Which transformers modules compute a known formula: the reference class itself or one whose ``forward`` has the
same source (transformers copies Llama's modules into most families with "Copied from"), so that the engine swaps in
a faster forward only where the model's own would compute the same thing."""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def has_forward_of(cls: type[torch.nn.Module], reference: type[torch.nn.Module]) -> bool:
    """``cls`` is ``reference`` or its ``forward`` has ``reference.forward``'s source."""
    try:
        return cls is reference or inspect.getsource(cls.forward) == inspect.getsource(reference.forward)
    except (OSError, TypeError):  # no source to compare: keep the model's own forward
        return False
