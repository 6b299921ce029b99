"""A fake ``sglang`` package for CPU tests: ``sglang.Engine`` with 0.5.23's API and behaviours.

Only the engine worker spawned by the SGLang-backend tests imports it (``tests/fakes`` is put on that
process's PYTHONPATH); the test process itself never can. ``FAKE_SGLANG_VERSION=0.5.17`` gives the
older API (no weight-update sessions, no ``get_model_info``). See ``srt/entrypoints/engine.py``.
"""

import os

__version__ = os.environ.get("FAKE_SGLANG_VERSION", "0.5.23")

from sglang.srt.entrypoints.engine import Engine  # noqa: E402  (the version must be known first)

__all__ = ["Engine", "__version__"]
