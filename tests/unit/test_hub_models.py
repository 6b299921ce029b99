"""``model.path: org/name[@revision]`` resolved through huggingface_hub's cache, offline: a cache laid out as
the hub writes it (``models--org--name/snapshots/<hash>/`` and ``refs/main``) under a temporary HF_HUB_CACHE,
holding a tiny model; a local path is left alone; an uncached id offline is one clear line."""

from __future__ import annotations

import shutil

import pytest

from minimal_config import run_config
from rlrun.data.hub import ModelPathError, resolve_model_path, with_local_model_paths
from tiny_models import make_tiny_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    model = make_tiny_model("qwen2", tmp_path / "tiny")
    repo = tmp_path / "hub" / "models--acme--tiny-qwen2"
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def test_hub_id_resolves_to_the_cached_snapshot(hub_cache, tmp_path):
    assert resolve_model_path("acme/tiny-qwen2") == str(hub_cache)
    assert resolve_model_path(f"acme/tiny-qwen2@{COMMIT}") == str(hub_cache)
    local = tmp_path / "tiny"
    assert resolve_model_path(str(local)) == str(local)  # a directory on disk is used as is
    cfg = run_config({"model": {"path": "acme/tiny-qwen2"}, "data": {"path": "d.jsonl"}, "rollout": {"reward": "math"}})
    resolved = with_local_model_paths(cfg)
    assert resolved.model.path == str(hub_cache) and cfg.model.path == "acme/tiny-qwen2"
    assert (hub_cache / "config.json").is_file()


def test_uncached_hub_id_offline_is_one_clear_line(hub_cache):
    with pytest.raises(ModelPathError) as info:
        resolve_model_path("acme/not-downloaded")
    message = str(info.value)
    assert message.startswith("model.path (acme/not-downloaded) is a Hugging Face hub id that is not in the cache (")
    assert "HF_HUB_OFFLINE=1 forbids downloading it; run `hf download acme/not-downloaded`" in message
    assert "\n" not in message
    with pytest.raises(ModelPathError, match=r"model.path \(acme/tiny-qwen2@v9\)"):
        resolve_model_path("acme/tiny-qwen2@v9")  # a revision the cache does not have
