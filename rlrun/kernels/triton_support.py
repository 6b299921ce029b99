"""Whether Triton is importable. rlrun's Triton kernels (``rlrun/kernels/rope.py``,
``rlrun/megatron/token_stats_triton.py``, ``rlrun/engine/embedded/triton_kernels.py``) run on CUDA where it is, and
their callers fall back to eager PyTorch where it is not (CPU installs have no Triton)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def launch_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where to launch a Triton kernel on ``tensor``: Triton launches on the current CUDA device and its stream, so
    under ``torch.cuda.device`` of the tensor (rlrun.engine.embedded.triton_kernels says why); on CPU (Triton's
    interpreter, ``TRITON_INTERPRET=1``, which the kernels' CPU tests run under) nothing."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
