"""Eight CPU ranks in one composite layout (scripts/cluster_layouts.py): trainer TP=2 x PP=2 x DP=2 with four
engine groups of ``engine.tp: 2``, trained on a one-rank baseline's saved samples; step 0's loss, entropy and
gradient norm equal the baseline's to 1e-5 relative, the later losses to 1e-4. The MoE layout's numbers are in
benchmarks/results/cluster_layouts_cpu.md (the script's full run)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from cluster_layouts import REL, run_layouts  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
if os.environ.get("RLRUN_CLUSTER_TESTS") != "1":
    pytest.skip("cluster stage only: RLRUN_CLUSTER_TESTS=1 (bash launch/ci/cluster_tests.sh)", allow_module_level=True)


def test_tp2_pp2_dp2_with_engine_tp2_matches_one_rank(tmp_path):
    result = run_layouts(tmp_path, ["dense_tp2_pp2_dp2"])
    layout = result["layouts"]["dense_tp2_pp2_dp2"]
    assert layout["rc"] == 0, layout["tail"]
    # four engine groups: the leaders (global ranks 0, 2, 4, 6) each run one engine
    assert layout["engine_logs"] == [f"engine-{rank}.log" for rank in (0, 2, 4, 6)]
    for key, values in layout["step0"].items():
        assert values["rel"] < REL, (key, values)
    assert max(layout["loss_rel_per_step"]) < 10 * REL
    assert layout["ok"]
