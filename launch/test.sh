#!/usr/bin/env bash
# Install and run the CPU test suite (GPU tests are marked and skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
VENV="${RLRUN_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
# Three pytest-xdist workers, one test file each at a time (a file's tests share module fixtures): most tests
# start torchrun ranks and engine workers that wait on each other, so even three files leave 2 cores partly idle
# (fresh clone, 2 idle cores: 732-851 s of pytest with three workers, the long e2e runs left to CI's second stage).
exec "$VENV/bin/python" -m pytest -n "${RLRUN_TEST_WORKERS:-3}" --dist loadfile tests "$@"
