"""The rlrun CLI as users run it (``python -m rlrun``, real subprocesses): clean one-line config
errors without tracebacks, resolved config output, and no torch/Megatron imports on the light paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from minimal_config import write_config
from rlrun.config import load_config

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "transformers")


def rlrun(*args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "rlrun", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def imported_modules(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.fixture
def good_config(tmp_path, tiny_model_dirs) -> Path:
    path = tmp_path / "good.yaml"
    return write_config(path, f"model:\n  path: {tiny_model_dirs['llama']}\nrollout:\n  temperature: 0.5\n")


@pytest.mark.parametrize("command", ["validate", "show"])
def test_bad_config_is_one_line_on_stderr_without_traceback(tmp_path, command):
    path = tmp_path / "bad.yaml"
    write_config(path, "rollout:\n  temperature: 0.5\n  temprature: 2\n")
    result = rlrun("config", command, str(path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"{path}:3: unknown key 'rollout.temprature' (did you mean 'temperature'?)\n"


def test_train_with_a_bad_override_exits_cleanly(good_config):
    result = rlrun("train", str(good_config), "--set", "rollout.max_new_tokens=0")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr
        == "--set rollout.max_new_tokens=0: rollout.max_new_tokens (0) must be greater than or equal to 1\n"
    )


def test_train_refuses_flash_varlen_without_cuda_in_one_line(good_config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = rlrun("train", str(good_config), "--set", "model.packed_attention=flash_varlen")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"{good_config}: model.packed_attention (flash_varlen) needs CUDA")


def test_validate_checks_model_dir_and_prompt_rows(tmp_path, good_config):
    missing_model = rlrun("config", "validate", str(good_config), "--set", f"model.path={tmp_path}/none")
    assert missing_model.returncode == 1
    assert missing_model.stderr.startswith(
        f"--set model.path={tmp_path}/none: model.path ({tmp_path}/none) must name a Hugging Face model directory"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "label": 1}\n{"prompt": "b"}\n')
    bad_rows = rlrun("config", "validate", str(good_config), "--set", f"data.path={rows}")
    where = f"--set data.path={rows}: data.path: {rows}:2:"
    assert bad_rows.returncode == 1 and bad_rows.stderr.startswith(f"{where} missing key 'label'")
    rows.write_text('{"prompt": "a", "label": 1}\n{"prompt": "b", "lab')  # truncated mid-write
    cut = rlrun("config", "validate", str(good_config), "--set", f"data.path={rows}")
    assert cut.returncode == 1 and cut.stderr.startswith(f"{where} invalid JSON (Unterminated string")


def test_train_from_another_directory_names_each_missing_input_before_any_process_starts(tmp_path):
    """The quickstart config's relative paths, run from elsewhere: one line per input, with the directory
    they were read against and how to make them; no run directory, no engine worker."""
    result = subprocess.run(
        [sys.executable, "-m", "rlrun", "train", str(REPO / "configs/quickstart.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    where = f"does not exist relative to {tmp_path} (the directory rlrun runs in)"
    quickstart = REPO / "configs/quickstart.yaml"
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == [
        f"{quickstart}:13: model.path (.cache/models/SmolLM2-135M-Instruct) must name a Hugging Face model directory "
        f"(config.json, weights, tokenizer) because the run reads it, but it {where}; run `rlrun prepare smollm2 --out "
        ".cache/models/SmolLM2-135M-Instruct`, or set model.path to an absolute path",
        f"{quickstart}:20: data.path (configs/data/addition_train.jsonl) must name a prompt file (.jsonl or .parquet) "
        "or a datasets directory because the run "
        f"reads it, but it {where}; run `python configs/data/make_addition.py` in the repository, or set data.path "
        "to an absolute path",
    ]
    assert list(tmp_path.iterdir()) == []  # no runs/quickstart, no engine log


def test_validate_ok_and_show_without_heavy_imports(good_config):
    result = rlrun("config", "validate", str(good_config), "--set", "train.num_steps=3", importtime=True)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.startswith(f"ok: {good_config}: model ") and "3 steps of 4 prompts x 8 samples" in result.stdout
    )
    modules = imported_modules(result.stderr)
    probe = {"rlrun.config.load", "rlrun.preflight.inputs", "rlrun.data.prompt_files", "typer"}
    assert probe <= modules  # the probe sees imports
    assert not [m for m in modules if m.split(".")[0] in HEAVY]

    shown = rlrun("config", "show", str(good_config), "--set", "optimizer.lr=3e-6")
    assert shown.returncode == 0
    expected = load_config(good_config, ["optimizer.lr=3e-6"]).model_dump(mode="json")
    assert yaml.safe_load(shown.stdout) == expected


def test_help_is_light():
    result = rlrun("--help", importtime=True)
    assert result.returncode == 0
    assert all(name in result.stdout for name in ("train", "config", "prepare"))
    modules = imported_modules(result.stderr)
    assert "rlrun.cli" in modules and not [m for m in modules if m.split(".")[0] in HEAVY]
