"""The embedded worker starts with cuBLAS's workspace off (its decode GEMMs round as the trainer's); other
backends' workers get the trainer's environment as it is. Read from the live worker's /proc environ."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_contract import spawn_engine

pytestmark = pytest.mark.slow


def worker_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.parametrize(
    ("backend", "extra_env", "expected"),
    [
        ("embedded", {}, ":0:0"),
        ("embedded", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, ":4096:8"),  # the caller's extra_env wins
        ("sglang", {}, None),
    ],
)
def test_worker_env_reaches_the_worker(backend, extra_env, expected, tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    engine = spawn_engine(backend, tiny_model_dirs["qwen2"], tmp_path, extra_env=extra_env)
    try:
        assert worker_environ(engine.process.pid).get("CUBLAS_WORKSPACE_CONFIG") == expected
    finally:
        engine.shutdown()
