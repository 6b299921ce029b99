"""Whether Triton is importable. rlrun's Triton kernels (``rlrun/rope_kernel.py``,
``rlrun/megatron/token_stats_triton.py``, ``rlrun/engine/backends/triton_kernels.py``) run on CUDA where it is, and
their callers fall back to eager PyTorch where it is not (CPU installs have no Triton)."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
