#!/usr/bin/env bash
# Install, prepare SmolLM2-135M-Instruct (GGUF -> HF directory, cached) and run the CPU quickstart
# on 2 ranks. Extra arguments are passed to `rlrun train` (e.g. --set parallel.tp=2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
VENV="${RLRUN_VENV:-.venv}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
"$VENV/bin/python" -m rlrun prepare smollm2
NPROC="${NPROC:-2}"
exec "$VENV/bin/torchrun" --standalone --nproc-per-node "$NPROC" -m rlrun train configs/quickstart.yaml "$@"
