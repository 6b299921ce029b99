#!/usr/bin/env bash
# Install and run the CPU test suite (GPU tests are marked and skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
VENV="${RLRUN_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
exec "$VENV/bin/python" -m pytest tests "$@"
