"""Shared fixtures: tiny random HF model directories (built once per session), the prepared SmolLM2, the gpu marker,
and the e2e marker (long multi-process runs that CI's second stage runs: launch/ci/cluster_tests.sh sets
RLRUN_CLUSTER_TESTS=1)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs CUDA")
    if os.environ.get("RLRUN_CLUSTER_TESTS") != "1":
        skips["e2e"] = pytest.mark.skip(
            reason="CI's second stage only: RLRUN_CLUSTER_TESTS=1 (launch/ci/cluster_tests.sh)"
        )
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{"llama": dir (tied embeddings), "qwen2": dir (QKV bias), "qwen3": dir (QK-norm)}."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {
        "llama": make_tiny_model("llama", root / "llama", tie=True),
        "qwen2": make_tiny_model("qwen2", root / "qwen2"),
        "qwen3": make_tiny_model("qwen3", root / "qwen3"),
    }


@pytest.fixture(scope="session")
def family_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """The RoPE-scaling and Mistral kinds of ``tiny_models.FAMILY_KINDS`` (llama3, linear, YaRN, mistral)."""
    from tiny_models import FAMILY_KINDS, make_tiny_model

    root = tmp_path_factory.mktemp("family_models")
    return {kind: make_tiny_model(kind, root / kind) for kind in FAMILY_KINDS}


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE (4 experts, top-2, QK-norm) HF dir, per-expert tensors on disk."""
    from tiny_models import make_tiny_model

    return make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny_moe") / "qwen3_moe")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The repository's SmolLM2-135M-Instruct directory, prepared here when no earlier test or run did (``rlrun
    prepare smollm2``, about 30 s on a fresh clone; xdist workers asking at once take turns on its lock file)."""
    from rlrun.tools.prepare import prepare_smollm2

    return prepare_smollm2(SMOLLM2)
