#!/usr/bin/env bash
# CI's cluster stage: start a one-host Slurm (launch/ci/slurm_up.sh), then run the tests that launch the way
# clusters do: sbatch jobs on it (tests/cluster/test_slurm.py), two torchrun nodes on this host
# (tests/integration/test_two_nodes.py), eight ranks in one composite layout (tests/cluster/test_eight_ranks.py), and
# the long runs marked e2e (engine ranks, engine restarts with rollouts ahead, the multi-GPU script's layouts, the
# calculator example's CLI run, the bench of both backends).
# They are skipped in the main suite (launch/test.sh) unless RLRUN_CLUSTER_TESTS=1; the Slurm daemons are
# stopped when this script exits. Needs root (apt-get, the daemons). Extra arguments go to both pytest runs.
# The Slurm, two-node and eight-rank tests run one at a time (each fills the host); the e2e files run as the main
# suite does, three at a time (launch/test.sh says why three).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${RLRUN_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 RLRUN_CLUSTER_TESTS=1
bash launch/ci/slurm_up.sh
trap 'bash launch/ci/slurm_down.sh' EXIT
status=0
"$VENV/bin/python" -m pytest -q -m "slurm or cluster" tests/cluster tests/integration/test_two_nodes.py "$@" || status=$?
"$VENV/bin/python" -m pytest -q -m e2e -n 3 --dist loadfile \
  tests/integration/test_disaggregated.py tests/integration/test_async_restart_disaggregated.py \
  tests/integration/test_async_loop.py tests/integration/test_multi_rank_layouts.py \
  tests/integration/test_rollout_cli.py tests/integration/test_engine_sglang_fake.py "$@" || status=$?
exit "$status"
