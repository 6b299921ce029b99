"""The preflight (rlrun/preflight/): everything a config names, checked before any process starts, each problem
one line led by the file and line of its key; base configs (``base:``) and the lines their keys keep."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlrun.config import ConfigError, read_config
from rlrun.preflight import preflight
from rlrun.preflight.hooks import HOOKS, set_values

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "configs/data/addition_train.jsonl"


def config(tmp_path: Path, model: Path, extra: str = "", name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"model:\n  path: {model}\ndata:\n  path: {PROMPTS}\nrollout:\n  reward: first_number\n{extra}")
    return path


def problems(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as err:
        preflight(read_config(path, overrides))
    return str(err.value).splitlines()


def test_a_good_config_passes(tmp_path, tiny_model_dirs):
    cfg = preflight(read_config(config(tmp_path, tiny_model_dirs["llama"])))
    assert cfg.model.path == str(tiny_model_dirs["llama"])


def test_a_bad_hook_names_its_file_and_line(tmp_path, tiny_model_dirs):
    path = config(tmp_path, tiny_model_dirs["llama"], "  dynamic_filter: no_such_module_xyz:keep\n")
    [line] = problems(path)
    assert line.startswith(f"{path}:7: rollout.dynamic_filter ('no_such_module_xyz:keep') must be a built-in")
    assert "fn(group: list[Sample]) -> bool" in line


def test_a_backend_check_names_its_file_and_line(tmp_path, tiny_model_dirs):
    path = config(tmp_path, tiny_model_dirs["llama"], "engine:\n  backend: sglang\n  verify_weights: true\n")
    assert problems(path) == [
        f"{path}:9: engine.verify_weights (true) must be false with backend sglang because it offers no per-tensor "
        "weight checksums; set it to false or use backend embedded"
    ]
    unknown = config(tmp_path, tiny_model_dirs["llama"], "engine:\n  backend: nope\n")
    [line] = problems(unknown)
    assert line.startswith(f"{unknown}:8: engine.backend ('nope') must be one of ['embedded', 'sglang']")


def test_a_refused_family_fails_validate_as_it_fails_train(tmp_path, tiny_model_dirs):
    gemma = tmp_path / "gemma2"
    shutil.copytree(tiny_model_dirs["llama"], gemma)
    hf = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**hf, "model_type": "gemma2"}))
    path = config(tmp_path, gemma)
    [line] = problems(path)
    from rlrun.megatron.hf_config import ModelArch  # train's check (imports torch; the preflight does not)

    with pytest.raises(ValueError) as train_error:
        ModelArch.from_hf_dir(gemma)
    assert line == f"{path}:2: model.path ({gemma}): {train_error.value}"
    assert "gemma2" in line and "soft-capping" in line


def test_a_key_from_a_base_config_names_the_base_files_line(tmp_path, tiny_model_dirs):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared/base.yaml").write_text("# shared sampling\nrollout:\n  temperature: -1\n  top_p: 0.9\n")
    (tmp_path / "shared/more.yaml").write_text("rollout:\n  top_p: 0.5\n")
    path = config(tmp_path, tiny_model_dirs["llama"], "base: [shared/base.yaml, shared/more.yaml]\n")
    with pytest.raises(ConfigError) as err:
        read_config(path)
    assert str(err.value) == f"{tmp_path / 'shared/base.yaml'}:3: rollout.temperature (-1) must be greater than 0"
    bases = "base: [shared/base.yaml, shared/more.yaml]\n"
    fixed = config(tmp_path, tiny_model_dirs["llama"], f"  temperature: 0.7\n{bases}")
    loaded = read_config(fixed)
    assert (loaded.cfg.rollout.temperature, loaded.cfg.rollout.top_p) == (0.7, 0.5)  # the file, then bases in order
    assert loaded.where("rollout.top_p") == f"{tmp_path / 'shared/more.yaml'}:2"
    assert loaded.where("rollout.temperature") == f"{fixed}:7"


def test_base_configs_that_are_missing_or_loop_are_refused(tmp_path, tiny_model_dirs):
    path = config(tmp_path, tiny_model_dirs["llama"], "base: nope.yaml\n")
    with pytest.raises(ConfigError, match=rf"^{path}:7: base \(nope.yaml\) must name an existing YAML config"):
        read_config(path)
    loop = tmp_path / "loop.yaml"
    loop.write_text("base: run.yaml\n")
    config(tmp_path, tiny_model_dirs["llama"], "base: loop.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        read_config(loop)


def test_the_hook_table_covers_every_hook_field():
    """Every schema field documented as a ``module:function`` hook path has a row (a new hook is one row)."""
    from rlrun.config.schema import RunConfig

    hook_fields = set()

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            members = getattr(annotation, "__args__", (annotation,))
            section = next((a for a in members if hasattr(a, "model_fields")), None)
            if section is not None:
                walk(section, f"{prefix}{name}.")
            elif "module:function" in (field.description or ""):
                hook_fields.add(f"{prefix}{name}")

    walk(RunConfig, "")
    rows = {h.key for h in HOOKS}
    assert hook_fields - rows == set(), "a hook field without a row in rlrun/preflight/hooks.py"
    assert len(rows) == len(HOOKS)


def test_set_values_expands_names_and_indices(tmp_path, tiny_model_dirs):
    path = config(tmp_path, tiny_model_dirs["llama"], "  rewards:\n    math: first_number\n")
    cfg = read_config(path).cfg
    assert set_values(cfg, "rollout.rewards.*") == [("rollout.rewards.math", "first_number")]
    assert set_values(cfg, "rollout.generate_fn") == []
