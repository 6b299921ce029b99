"""Kernel tests on CPU: a script of tests/unit run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy
arithmetic), where Triton is installed; the same kernels' bf16 numerics are GPU questions (tests/gpu)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INTERPRETER_SITE = Path(sys.prefix) / "triton-interpreter"
"""Triton and a NumPy its interpreter runs with, apart from the venv (launch/install.sh,
requirements/cpu-interpreter.txt); first on the interpreted processes' path where it is."""
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None and not (INTERPRETER_SITE / "triton").is_dir(),
    reason="needs Triton (its interpreter runs on CPU; launch/install.sh puts it in .venv/triton-interpreter)",
)


_RUNTIME_BOUND_LOOP = """
import torch, triton, triton.language as tl
@triton.jit
def loop(out, n, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        total += 1
    tl.store(out, tl.sum(total, axis=0))
out = torch.zeros(1, dtype=torch.int32)
loop[(1,)](out, 10, BLOCK=4)
assert out.item() == 12, out
print("ok")
"""
"""A loop over a kernel argument, as every kernel here has: Triton's interpreter (3.5.1 and 3.6.0) passes a scalar
argument as a 1-element array and takes ``int()`` of it, which NumPy 2.4 and later refuse (NumPy 2.3 runs them)."""


def _interpreted(code: list[str], timeout: float) -> subprocess.CompletedProcess:
    site = [str(INTERPRETER_SITE)] if INTERPRETER_SITE.is_dir() else []
    path = os.pathsep.join([*site, str(REPO), str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, *code], env=env, capture_output=True, text=True, timeout=timeout)


@functools.cache
def _interpreter_broken() -> str | None:
    """Why this Triton's interpreter cannot run the kernels here, or None."""
    proc = _interpreted(["-c", _RUNTIME_BOUND_LOOP], timeout=120)
    if proc.returncode == 0 and proc.stdout.strip().endswith("ok"):
        return None
    versions = _interpreted(["-c", "import numpy, triton; print(triton.__version__, numpy.__version__)"], timeout=120)
    triton_version, numpy_version = (versions.stdout.split() + ["?", "?"])[:2]
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return (
        f"Triton {triton_version}'s interpreter with NumPy {numpy_version} cannot loop to a kernel argument ({last}); "
        "NumPy < 2.4 beside Triton runs them"
    )


def run_interpreted(script: str, timeout: float = 600) -> None:
    """Run ``tests/unit/<script>`` in a fresh interpreted process (the repository and tests/ on its path); it must
    exit 0 with ``ok`` as its last line. Skipped, with the reason, where the interpreter itself cannot run a loop to a
    kernel argument (the kernels' CUDA tests in tests/gpu still run there)."""
    broken = _interpreter_broken()
    if broken:
        pytest.skip(broken)
    proc = _interpreted([str(REPO / "tests" / "unit" / script)], timeout)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
