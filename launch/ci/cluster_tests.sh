#!/usr/bin/env bash
# CI's cluster stage: start a one-host Slurm (launch/ci/slurm_up.sh), then run the tests that launch the way
# clusters do: sbatch jobs on it (tests/cluster/test_slurm.py), two torchrun nodes on this host
# (tests/integration/test_two_nodes.py), eight ranks in one composite layout (tests/cluster/test_eight_ranks.py), and
# the long runs marked e2e (engine ranks, engine restarts with rollouts ahead).
# They are skipped in the main suite (launch/test.sh) unless RLRUN_CLUSTER_TESTS=1; the Slurm daemons are
# stopped when this script exits. Needs root (apt-get, the daemons). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${RLRUN_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 RLRUN_CLUSTER_TESTS=1
bash launch/ci/slurm_up.sh
trap 'bash launch/ci/slurm_down.sh' EXIT
"$VENV/bin/python" -m pytest -q -m "slurm or cluster or e2e" \
  tests/cluster tests/integration/test_two_nodes.py tests/integration/test_disaggregated.py \
  tests/integration/test_async_restart_disaggregated.py tests/integration/test_async_loop.py "$@"
