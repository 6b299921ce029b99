"""A backend registered from the tests (tests/integration/test_registered_backend.py): the embedded engine
under another name and other traits, writing the spec it was built from to ``server_args["record_to"]``.
It lives on the worker's PYTHONPATH only, like the fake sglang package."""

from __future__ import annotations

from pathlib import Path

from rlrun.engine.embedded.backend import EmbeddedBackend
from rlrun.engine.registry import BackendSpec


def build(spec: BackendSpec) -> EmbeddedBackend:
    Path(spec.server_args["record_to"]).write_text(spec.to_json())
    return EmbeddedBackend.from_spec(spec)
