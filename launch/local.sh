#!/usr/bin/env bash
# rlrun on this machine: one rank per GPU (or NPROC CPU processes when there is no GPU).
#
#   bash launch/local.sh CONFIG [--set key=value ...]
#   NPROC=4 bash launch/local.sh configs/qwen3-0.6b-gsm8k.yaml --set train.num_steps=10
#
# Ctrl-C stops at once; SIGTERM or SIGUSR1 to torchrun makes every rank checkpoint and stop, and the
# same command continues from there (checkpoint.resume: auto). RLRUN_DRY_RUN=1 prints the command.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:?usage: bash launch/local.sh CONFIG [--set key=value ...]}
shift
VENV="${RLRUN_VENV:-.venv}"
if [[ -z ${NPROC:-} ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then NPROC=$(nvidia-smi -L | wc -l); else NPROC=2; fi
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
command -v nvidia-smi >/dev/null 2>&1 || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

CMD=("$VENV/bin/torchrun" --standalone --nproc-per-node="$NPROC"
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=300
  -m rlrun train "$CONFIG" "$@")
if [[ ${RLRUN_DRY_RUN:-0} == 1 ]]; then
  echo "${CMD[*]}"
  exit 0
fi
exec "${CMD[@]}"
