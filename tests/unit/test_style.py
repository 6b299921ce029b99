"""The tree passes ruff's lint (pyflakes, import order, ``zip(strict=)``, line length) and formatter as
configured in pyproject.toml, so style stops drifting. Fix with ``ruff check --fix . && ruff format .``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check", "--no-cache", "."], ["format", "--no-cache", "--check", "."]])
def test_ruff(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout}{result.stderr}"
