"""Which weights ``algorithm.ref.path`` / ``ref.step`` name: config-time checks, checkpoint step choice
(complete checkpoints only, errors naming the available steps), and the layout check's message."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlrun.config.schema import AlgorithmConfig
from rlrun.trainer.checkpoint import COMPLETE, Layout, check_layout
from rlrun.trainer.roles import _ref_checkpoint


def make_checkpoints(root: Path, complete: list[int], partial: list[int]) -> None:
    """Step directories as the checkpointer leaves them: a COMPLETE marker with the layout, or none."""
    for step in complete + partial:
        (root / f"step_{step:06d}").mkdir(parents=True)
    for step in complete:
        marker = {"step": step, "layout": {"world_size": 2, "tp": 2, "pp": 1}}
        (root / f"step_{step:06d}" / COMPLETE).write_text(json.dumps(marker))


def test_step_without_path_fails_at_config_load():
    with pytest.raises(ValidationError, match=r"algorithm.ref.step \(3\) must come with algorithm.ref.path"):
        AlgorithmConfig(kl={"loss_coef": 0.1}, ref={"step": 3})
    with pytest.raises(ValidationError, match=r"greater than or equal to 0"):
        AlgorithmConfig(kl={"loss_coef": 0.1}, ref={"path": "x", "step": -1})
    assert AlgorithmConfig(kl={"loss_coef": 0.1}, ref={"path": "x", "step": 0}).ref.step == 0


def test_checkpoint_choice(tmp_path):
    make_checkpoints(tmp_path, complete=[1, 3], partial=[4])
    assert _ref_checkpoint(str(tmp_path), None) == tmp_path / "step_000003"  # newest complete, not step 4
    assert _ref_checkpoint(str(tmp_path), 1) == tmp_path / "step_000001"
    assert _ref_checkpoint(str(tmp_path / "step_000001"), None) == tmp_path / "step_000001"
    assert _ref_checkpoint(str(tmp_path / "step_000003"), 3) == tmp_path / "step_000003"
    for step in (2, 4):
        with pytest.raises(ValueError, match=rf"ref.step \({step}\) must name .* available complete steps: \[1, 3\]"):
            _ref_checkpoint(str(tmp_path), step)
    with pytest.raises(ValueError, match=r"must match the checkpoint"):
        _ref_checkpoint(str(tmp_path / "step_000003"), 1)
    with pytest.raises(ValueError, match=r"must be a complete checkpoint"):
        _ref_checkpoint(str(tmp_path / "step_000004"), None)


def test_hf_directory_and_none_are_not_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _ref_checkpoint(str(tmp_path), None) is None
    assert _ref_checkpoint(None, None) is None
    with pytest.raises(ValueError, match=r"ref.step \(2\) must be unset .* not an rlrun checkpoint directory"):
        _ref_checkpoint(str(tmp_path), 2)
    empty = tmp_path / "ckpts"
    make_checkpoints(empty, complete=[], partial=[5])
    with pytest.raises(ValueError, match=r"available complete steps: none"):
        _ref_checkpoint(str(empty), None)


def test_layout_mismatch_names_both_layouts(tmp_path):
    make_checkpoints(tmp_path, complete=[1], partial=[])
    step_dir = tmp_path / "step_000001"
    check_layout(step_dir, Layout(world_size=2, tp=2, pp=1), "fix")
    with pytest.raises(ValueError) as info:
        check_layout(step_dir, Layout(world_size=2, tp=1, pp=1), "or do something else")
    message = str(info.value)
    assert "Layout(world_size=2, tp=2, pp=1)" in message and "Layout(world_size=2, tp=1, pp=1)" in message
    assert message.endswith("or do something else")
