"""The SGLang server arguments a run asks for: the user's, plus what its algorithm needs of the engine."""

from __future__ import annotations

from pathlib import Path

from rlrun.config import load_config
from rlrun.loop import engine_server_args


def config(tmp_path: Path, *overrides: str, text: str = "{}\n"):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_rollout_routing_replay_asks_sglang_for_routed_experts(tmp_path):
    cfg = config(
        tmp_path,
        "algorithm.routing_replay=rollout",
        text="engine:\n  backend: sglang\n  sglang_server_args: {mem_fraction_static: 0.5}\n",
    )
    assert engine_server_args(cfg) == {"mem_fraction_static": 0.5, "enable_return_routed_experts": True}
    assert cfg.engine.sglang_server_args == {"mem_fraction_static": 0.5}  # the config is not modified


def test_other_runs_pass_the_users_server_args_unchanged(tmp_path):
    assert engine_server_args(config(tmp_path, "engine.backend=sglang")) == {}
    assert engine_server_args(config(tmp_path, "algorithm.routing_replay=trainer")) == {}
