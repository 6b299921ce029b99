"""Models by name: ``model.path: org/name`` (or ``org/name@revision``) read from the Hugging Face cache.

A path that exists on disk is used as is. Otherwise a value shaped like a hub id is resolved once, before any
process loads it, to its snapshot directory through ``huggingface_hub`` (downloaded when online;
``HF_HUB_OFFLINE=1`` reads the cache only, and a model not in it is one clear error). Every consumer (the
trainer's Megatron config, the engines, the tokenizer) then gets the local directory:
:func:`with_local_model_paths` returns the config with the resolved paths.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_TRUE = {"1", "true", "yes", "on"}


class ModelPathError(ValueError):
    """A model path that is neither a local directory nor a hub id the cache (or the hub) has."""


def is_hub_id(value: str) -> bool:
    """Whether ``value`` reads as ``org/name[@revision]`` and is not a path on disk."""
    return _HUB_ID.match(value) is not None and not Path(value).exists()


def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment now (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home) / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def resolve_model_path(value: str, key: str = "model.path") -> str:
    """The local directory ``value`` names: itself when it exists or is no hub id, else the hub snapshot."""
    match = _HUB_ID.match(value)
    if match is None or Path(value).exists():
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo, revision, cache = match["repo"], match["revision"], hub_cache_dir()
    try:
        return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=offline())
    except LocalEntryNotFoundError:
        if offline():
            raise ModelPathError(
                f"{key} ({value}) is a Hugging Face hub id that is not in the cache ({cache}) and HF_HUB_OFFLINE=1 "
                f"forbids downloading it; run `hf download {repo}` where the hub is reachable, or set {key} to a "
                "local directory"
            ) from None
        raise ModelPathError(
            f"{key} ({value}) is neither a local directory nor a model the Hugging Face hub could serve; "
            f"check the name and the network, or set {key} to a local directory"
        ) from None
    except Exception as err:  # noqa: BLE001 - huggingface_hub raises many types (unknown repo, revision, auth)
        raise ModelPathError(
            f"{key} ({value}) could not be resolved on the Hugging Face hub ({type(err).__name__}: {err}); "
            f"check the name and revision, or set {key} to a local directory"
        ) from None


def with_local_model_paths(cfg):
    """``cfg`` with ``model.path``, ``algorithm.ref.path`` and ``algorithm.opd.teacher_path`` resolved to local
    directories (a new config: the loaded one is never changed)."""
    model = cfg.model.model_copy(update={"path": resolve_model_path(cfg.model.path)})
    algorithm = cfg.algorithm
    ref, opd = algorithm.ref, algorithm.opd
    if ref.path is not None:
        ref = ref.model_copy(update={"path": resolve_model_path(ref.path, "algorithm.ref.path")})
    if opd.teacher_path is not None:
        opd = opd.model_copy(
            update={"teacher_path": resolve_model_path(opd.teacher_path, "algorithm.opd.teacher_path")}
        )
    algorithm = algorithm.model_copy(update={"ref": ref, "opd": opd})
    return cfg.model_copy(update={"model": model, "algorithm": algorithm})
