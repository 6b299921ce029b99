"""A backend added from the tests, with no change outside rlrun/engine/backends/: its traits (not its
name) decide what the config accepts and what the worker is started with, and a real worker process
builds it from its factory path and serves the contract."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

import pytest

from engine_contract import FAKES_DIR
from minimal_config import run_config
from rlrun.config.schema import RunConfig
from rlrun.engine.registry import BACKENDS, BackendSpec, BackendTraits, register_backend
from rlrun.preflight.engine import engine_problems

RLRUN = Path(__file__).resolve().parents[2] / "rlrun"
RECORDING = BackendTraits(
    factory="recording_backend:build",
    shards_over_tp=False,
    supports_checksums=False,
    accepts_server_args=True,
    routed_experts_args={"record_routed_experts": True},
)


@pytest.fixture
def recording_backend():
    register_backend("recording", RECORDING)
    yield "recording"
    del BACKENDS["recording"]


def config(model_dir, record_to, **algorithm) -> RunConfig:
    return run_config(
        {
            "model": {"path": str(model_dir)},
            "engine": {"backend": "recording", "server_args": {"record_to": str(record_to)}},
            "algorithm": algorithm,
        }
    )


def checked(sections: dict) -> RunConfig:
    """The config once the preflight's engine checks passed (where the backend traits are read); else their
    first problem as a ``ValueError``."""
    cfg = run_config(sections)
    problems = engine_problems(cfg)
    if problems:
        raise ValueError(problems[0][1])
    return cfg


def test_traits_decide_the_config_and_the_spec(recording_backend, tmp_path):
    cfg = config(tmp_path, tmp_path / "spec.json", routing_replay="rollout")
    spec = BackendSpec.from_config(cfg, seed=5)
    assert spec.factory == "recording_backend:build" and spec.traits is RECORDING
    assert spec.server_args == {"record_to": str(tmp_path / "spec.json"), "record_routed_experts": True}
    assert cfg.engine.server_args == {"record_to": str(tmp_path / "spec.json")}  # the config is not modified
    assert BackendSpec.from_config(config(tmp_path, "x"), seed=5).server_args == {"record_to": "x"}
    with pytest.raises(ValueError, match=r"engine.verify_weights \(true\) must be false with backend recording"):
        checked({"engine": {"backend": "recording", "verify_weights": True}})
    with pytest.raises(
        ValueError,
        match=r"engine.server_args keys \['a'\] must be among "
        r"\['max_running_requests', 'chunked_prefill_size', 'session_cache_size'\]",
    ):
        checked({"engine": {"server_args": {"a": 1, "max_running_requests": 8}}})
    with pytest.raises(ValueError, match=r"engine.server_args must be empty with backend blind because it reads"):
        register_backend("blind", dataclasses.replace(RECORDING, accepts_server_args=False))
        try:
            checked({"engine": {"backend": "blind", "server_args": {"a": 1}}})
        finally:
            del BACKENDS["blind"]
    with pytest.raises(ValueError, match=r"engine.backend \('nope'\) must be one of \['embedded', 'recording'"):
        checked({"engine": {"backend": "nope"}})
    register_backend("blind", dataclasses.replace(RECORDING, routed_experts_args=None))
    try:
        with pytest.raises(ValueError, match=r"algorithm.routing_replay \(rollout\) must go with an engine that"):
            checked({"engine": {"backend": "blind"}, "algorithm": {"routing_replay": "rollout"}})
    finally:
        del BACKENDS["blind"]


def test_sglang_gets_routed_experts_only_for_rollout_replay():
    def spec(**algorithm):
        cfg = run_config(
            {"engine": {"backend": "sglang", "server_args": {"mem_fraction_static": 0.5}}, "algorithm": algorithm}
        )
        return BackendSpec.from_config(cfg, seed=0)

    routed = {"mem_fraction_static": 0.5, "enable_return_routed_experts": True}
    assert spec(routing_replay="rollout").server_args == routed
    assert spec(routing_replay="trainer").server_args == {"mem_fraction_static": 0.5}
    assert BackendSpec.from_config(run_config(), seed=0).server_args == {}  # embedded returns them unasked


def test_a_worker_builds_the_registered_backend(recording_backend, tiny_model_dirs, tmp_path):
    from rlrun.engine.client import EngineClient

    record = tmp_path / "spec.json"
    spec = BackendSpec.from_config(config(tiny_model_dirs["qwen2"], record), seed=3)
    pythonpath = os.pathsep.join(p for p in (str(FAKES_DIR / "backends"), os.environ.get("PYTHONPATH")) if p)
    with EngineClient.spawn(spec, run_dir=tmp_path, rank=0, extra_env={"PYTHONPATH": pythonpath}) as engine:
        results = engine.generate([[257, 84, 82]], {"max_new_tokens": 3, "ignore_eos": True})
        assert [len(r["output_ids"]) for r in results] == [3]
    built = json.loads(record.read_text())
    assert built["backend"] == "recording" and built["seed"] == 3 and built["factory"] == "recording_backend:build"
    with pytest.raises(ValueError, match=r"engine tp_size \(2\) must be 1 for backend recording"):
        EngineClient.spawn(BackendSpec("recording", "m", 0, tp_size=2), run_dir=tmp_path, rank=0)


def _backend_names_compared(tree: ast.AST, names: set[str]) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for side in (node.left, *node.comparators)
        for value in ([side] if not isinstance(side, ast.Tuple | ast.List | ast.Set) else side.elts)
        if isinstance(value, ast.Constant) and value.value in names
    ]


def test_no_backend_names_compared_outside_engine_backends():
    found = {
        str(path.relative_to(RLRUN)): lines
        for path in RLRUN.rglob("*.py")
        if path.relative_to(RLRUN).parts[:2] != ("engine", "backends")
        and (lines := _backend_names_compared(ast.parse(path.read_text()), set(BACKENDS)))
    }
    assert not found, f"read BackendTraits instead of comparing backend names: {found}"
    assert _backend_names_compared(ast.parse('b = x.backend == "sglang"'), set(BACKENDS)) == [1]
