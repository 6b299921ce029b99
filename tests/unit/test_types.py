"""mypy over the packages pyproject.toml's ``[tool.mypy]`` names (rlrun/trainer, rlrun/engine, rlrun/algo) finds
no error; the trainer's functions are annotated throughout (``disallow_untyped_defs`` there). Run it by hand with
``.venv/bin/mypy`` (no arguments: the files come from the config; the cache in .mypy_cache makes reruns fast)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a cold run reads torch's stubs: about a minute


def test_mypy_finds_no_error():
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"mypy:\n{result.stdout}{result.stderr}"
    assert result.stdout.startswith("Success: no issues found"), result.stdout


def test_mypy_reports_a_wrong_type_of_the_trainer(tmp_path):
    """Not vacuous: a file that misuses a trainer type fails with the same settings."""
    bad = tmp_path / "bad_types.py"
    bad.write_text("from rlrun.trainer.batch import TrainBatch\n\nBATCH = TrainBatch(updates=[1])\n")
    result = subprocess.run([sys.executable, "-m", "mypy", str(bad)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1 and 'expected "Update"' in result.stdout, result.stdout
