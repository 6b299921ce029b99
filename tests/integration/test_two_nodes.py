"""Two torchrun agents as two nodes on this host (scripts/two_nodes.py): ``--nnodes 2``, c10d rendezvous on
127.0.0.1, two ranks each. The pair trains to the end with per-rank files named by global rank; SIGKILLing
node 1's session ends node 0 within seconds, saying why; the pair started again resumes from the newest
checkpoint and logs every remaining step once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from two_nodes import kill_node, resume, straight  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
if os.environ.get("RLRUN_CLUSTER_TESTS") != "1":
    pytest.skip("cluster stage only: RLRUN_CLUSTER_TESTS=1 (bash launch/ci/cluster_tests.sh)", allow_module_level=True)
STEPS = 4


def test_two_nodes_train_die_together_and_resume(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["qwen3"]
    run = straight(model, tmp_path, STEPS)
    assert run["exit_codes"] == [0, 0], run
    assert run["steps"] == list(range(STEPS))
    # 4 ranks, one engine each, named by global rank: no two ranks share a socket or a log
    assert run["run_dir_files"] == [f"engine-{rank}.log" for rank in range(4)], run

    kill = kill_node(model, tmp_path, STEPS, kill_after=2)
    assert kill["node0_exit_code"] != 0
    assert kill["detection_s"] < 60, kill
    assert kill["checkpoints"], kill

    done = resume(model, tmp_path, STEPS)
    assert done["exit_codes"] == [0, 0], done
    assert done["steps_after"] == list(range(STEPS)), done
