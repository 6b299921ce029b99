"""``rlrun doctor``: each config requirement is reported against what is really on disk and installed."""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata

from typer.testing import CliRunner

from minimal_config import run_config, write_config
from rlrun.cli import app
from rlrun.tools.doctor import config_checks, package_checks


def by_name(checks):
    return {c.name: c for c in checks}


def test_packages_report_the_installed_versions():
    checks = by_name(package_checks())
    assert checks["torch"].status == "ok" and checks["torch"].detail == metadata.version("torch")
    assert checks["megatron-core"].detail == metadata.version("megatron-core")


def test_config_requirements(tiny_model_dirs, tmp_path):
    (tmp_path / "ckpt").mkdir()
    cfg = run_config(
        {
            "model": {"path": str(tiny_model_dirs["llama"])},
            "engine": {"backend": "sglang"},
            "logging": {"tensorboard": True, "run_dir": str(tmp_path)},
            "checkpoint": {"resume": str(tmp_path / "ckpt")},
            "parallel": {"tp": 2},
        }
    )
    checks = by_name(config_checks(cfg, num_gpus=0))
    assert checks["model.path"].status == "ok"
    assert checks["data.path"].status == "ok" and "100 prompts" in checks["data.path"].detail
    assert checks["engine.backend"].status == "missing"  # no GPU here, whatever is installed
    tensorboard_found = importlib.util.find_spec("tensorboard") is not None
    assert checks["logging.tensorboard"].status == ("ok" if tensorboard_found else "missing")
    assert checks["checkpoint.resume"].status == "missing" and "COMPLETE" in checks["checkpoint.resume"].detail
    missing_model = run_config({"model": {"path": str(tmp_path / "nowhere")}})
    assert by_name(config_checks(missing_model, num_gpus=0))["model.path"].status == "missing"


def test_world_size_must_be_a_multiple_of_tp(monkeypatch):
    cfg = run_config({"parallel": {"tp": 2}})
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert by_name(config_checks(cfg, num_gpus=0))["parallel"].status == "missing"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "2 data-parallel replica(s)" in by_name(config_checks(cfg, num_gpus=0))["parallel"].detail


def test_engine_ranks_are_not_counted_as_training_ranks(monkeypatch):
    """6 ranks, 2 of them engine ranks forming one engine of engine.tp 2: 4 train, 2 replicas of tp 2."""
    cfg = run_config({"parallel": {"tp": 2}, "placement": {"engine_ranks": 2}, "engine": {"tp": 2}})
    monkeypatch.setenv("WORLD_SIZE", "6")
    check = by_name(config_checks(cfg, num_gpus=0))["parallel"]
    assert check.status == "ok" and check.detail == (
        "4 ranks = 2 data-parallel replica(s) of tp x pp = 2 + 2 engine ranks (1 engine(s) of engine.tp 2)"
    )
    monkeypatch.setenv("WORLD_SIZE", "5")  # 3 training ranks: not a multiple of tp 2
    assert by_name(config_checks(cfg, num_gpus=0))["parallel"].status == "missing"


def test_cli_exits_1_when_something_is_missing(tmp_path):
    config = tmp_path / "run.yaml"
    write_config(config, f"model:\n  path: {tmp_path / 'nowhere'}\n")
    result = CliRunner().invoke(app, ["doctor", str(config)])
    assert result.exit_code == 1
    assert "model.path" in result.output and "missing" in result.output


def test_model_family_and_features_are_listed(family_model_dirs, tmp_path):
    cfg = run_config({"model": {"path": str(family_model_dirs["qwen2_yarn"])}})
    checks = by_name(config_checks(cfg, num_gpus=0))
    assert checks["model.family"].status == "ok" and checks["model.family"].detail == "qwen2 (supported)"
    assert checks["model: RoPE"].status == "ok" and "yarn" in checks["model: RoPE"].detail
    assert checks["model: attention"].detail == "6 query heads, 3 key/value heads, q/k/v bias (supported)"
    assert checks["model: attention span"].status == "ok"
    # A refused family and feature: every row stays listed, the refused ones name the field and the reason.
    config = json.loads((family_model_dirs["mistral"] / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"")
    refused = {**config, "model_type": "gemma3_text", "use_sliding_window": True, "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(refused))
    checks = by_name(config_checks(run_config({"model": {"path": str(tmp_path)}}), num_gpus=0))
    assert checks["model.family"].status == "missing" and "(1 + w) RMSNorm" in checks["model.family"].detail
    assert checks["model: attention span"].status == "missing"
    assert checks["model: RoPE"].status == "ok"
