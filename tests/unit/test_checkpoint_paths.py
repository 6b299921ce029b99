"""Which checkpoint a run starts from (``checkpoint.resume`` / ``checkpoint.load``), the layout rule (any DP
size, same TP and PP) and the errors for missing or unfinished checkpoints, each naming the path."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlrun.config.schema import CheckpointConfig
from rlrun.megatron.checkpoint import check_shapes
from rlrun.trainer.checkpoint import Layout, Marker, check_layout, resolve_load, resolve_start


def make_checkpoint(path: Path, step: int, complete: bool = True, weights_only: bool = False) -> Path:
    (path / "actor").mkdir(parents=True)
    if complete:
        Marker(step=step, layout=Layout(world_size=2, tp=2, pp=1), weights_only=weights_only).write(path)
    return path


def test_resume_auto_prefers_the_runs_own_checkpoints_over_load(tmp_path):
    converted = make_checkpoint(tmp_path / "converted", 0, weights_only=True)
    own = tmp_path / "run" / "checkpoints"
    cfg = CheckpointConfig(load=str(converted))
    assert resolve_start(cfg, own) == converted  # nothing of its own yet: start from load
    make_checkpoint(own / "step_000002", 2)
    make_checkpoint(own / "step_000003", 3, complete=False)
    assert resolve_start(cfg, own) == own / "step_000002"  # restarted: continue, never go back to load
    assert resolve_start(cfg.model_copy(update={"resume": "none"}), own) == converted
    assert resolve_start(CheckpointConfig(resume="none"), own) is None


def test_load_takes_a_checkpoint_or_a_directory_of_them(tmp_path):
    make_checkpoint(tmp_path / "step_000001", 1)
    make_checkpoint(tmp_path / "step_000004", 4)
    assert resolve_load(str(tmp_path)) == tmp_path / "step_000004"
    assert resolve_load(str(tmp_path / "step_000001")) == tmp_path / "step_000001"
    with pytest.raises(ValueError, match=rf"checkpoint.load \('{tmp_path / 'nope'}'\) must be .* it does not exist"):
        resolve_load(str(tmp_path / "nope"))
    unfinished = make_checkpoint(tmp_path / "other" / "step_000005", 5, complete=False)
    with pytest.raises(ValueError, match="it holds none"):
        resolve_load(str(unfinished.parent))


def test_any_dp_size_loads_but_tp_and_pp_must_match(tmp_path):
    path = make_checkpoint(tmp_path / "step_000001", 1)
    check_layout(path, Layout(world_size=4, tp=2, pp=1), "fix")
    check_layout(path, Layout(world_size=2, tp=2, pp=1), "fix")
    for layout in (Layout(world_size=2, tp=1, pp=1), Layout(world_size=4, tp=2, pp=2)):
        with pytest.raises(ValueError, match=rf"checkpoint {path} layout .* set parallel.tp=2 and parallel.pp=1, fix"):
            check_layout(path, layout, "fix")


def test_unfinished_model_checkpoint_is_named(tmp_path):
    path = make_checkpoint(tmp_path / "step_000001", 1)
    with pytest.raises(ValueError, match=rf"checkpoint {path / 'actor'} must hold a Megatron distributed checkpoint"):
        check_shapes({}, path / "actor")


def test_resume_auto_continues_from_the_newest_of_several_complete_checkpoints(tmp_path):
    own = tmp_path / "checkpoints"
    newest = make_checkpoint(own / "step_000010", 10)
    make_checkpoint(own / "step_000009", 9)  # written last: the pick goes by step, not by time or name order
    make_checkpoint(own / "step_000002", 2)
    make_checkpoint(own / "step_000011", 11, complete=False)  # an unfinished save is never picked
    assert resolve_start(CheckpointConfig(resume="auto"), own) == newest
    assert resolve_load(str(own)) == newest  # checkpoint.load of a directory: its newest complete one too
