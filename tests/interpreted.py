"""Kernel tests on CPU: a script of tests/unit run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy
arithmetic), where Triton is installed; the same kernels' bf16 numerics are GPU questions (tests/gpu)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)"
)


def run_interpreted(script: str, timeout: float = 600) -> None:
    """Run ``tests/unit/<script>`` in a fresh interpreted process (the repository and tests/ on its path); it must
    exit 0 with ``ok`` as its last line."""
    path = os.pathsep.join([str(REPO), str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "unit" / script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
