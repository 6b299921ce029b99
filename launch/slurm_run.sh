#!/usr/bin/env bash
# Start rlrun on every node of the current Slurm allocation: srun runs one torchrun per node, torchrun
# starts one rank per GPU, and the ranks meet through a c10d rendezvous on the allocation's first node.
# Called by launch/slurm_1node.sbatch and launch/slurm_multinode.sbatch; also works inside `salloc`.
#
#   bash launch/slurm_run.sh CONFIG [--set key=value ...]
#
# Environment (all optional):
#   GPUS_PER_NODE   ranks per node (default: $SLURM_GPUS_ON_NODE; with no GPU allocated, CPU ranks:
#                   the GPUs nvidia-smi lists, else 2). A CPU job on a GPU script's defaults:
#                   GPUS_PER_NODE=2 sbatch --gpus-per-node=0 --cpus-per-task=2 launch/slurm_1node.sbatch CONFIG
#   RDZV_PORT       rendezvous port on the first node (default 29500)
#   TORCHRUN        torchrun executable (default: .venv/bin/torchrun if present, else torchrun on PATH)
#   RLRUN_LOG_DIR   every rank's stdout/stderr (default logs/slurm-$SLURM_JOB_ID); the console shows local rank 0
#   RLRUN_DRY_RUN=1 print the command instead of running it
# Cluster-specific NCCL settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) pass through from the environment.
set -euo pipefail
CONFIG=${1:?usage: bash launch/slurm_run.sh CONFIG [--set key=value ...]}
shift
: "${SLURM_JOB_ID:?run inside a Slurm allocation (sbatch or salloc)}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set; run inside a Slurm allocation}"

NNODES=${SLURM_NNODES:-1}
if [[ -z ${GPUS_PER_NODE:-} ]]; then
  if [[ ${SLURM_GPUS_ON_NODE:-0} -gt 0 ]]; then
    GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
  elif command -v nvidia-smi >/dev/null 2>&1; then
    GPUS_PER_NODE=$(nvidia-smi -L | wc -l)
  else
    GPUS_PER_NODE=2
  fi
fi
NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")  # not piped into head: SIGPIPE fails under pipefail
HEAD_NODE=${NODES%%$'\n'*}
# The rendezvous address: the head node's NodeAddr (its name unless slurm.conf sets one; several slurmd on one
# host share an address while their names need not resolve).
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' || true)
HEAD_ADDR=${HEAD_ADDR#NodeAddr=}
HEAD_ADDR=${HEAD_ADDR:-$HEAD_NODE}
RDZV_PORT=${RDZV_PORT:-29500}
if [[ -z ${TORCHRUN:-} ]]; then
  if [[ -x .venv/bin/torchrun ]]; then TORCHRUN=.venv/bin/torchrun; else TORCHRUN=torchrun; fi
fi
LOG_DIR=${RLRUN_LOG_DIR:-logs/slurm-$SLURM_JOB_ID}

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# CPU ranks (gloo): one thread each, or the ranks and engine workers oversubscribe the node's cores.
[[ ${SLURM_GPUS_ON_NODE:-0} -gt 0 ]] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Fail a hung NCCL collective instead of waiting forever (the process-group timeout applies).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# srun --kill-on-bad-exit: one node's torchrun failing ends the others at once.
# torchrun --signals-to-handle: forward SIGUSR1 (#SBATCH --signal=USR1@T) to the ranks, which then
# checkpoint and stop; --shutdown-timeout gives them that long before SIGKILL.
CMD=(srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --cpu-bind=none
  "$TORCHRUN" --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE"
  --rdzv-backend=c10d --rdzv-endpoint="$HEAD_ADDR:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=300
  --log-dir="$LOG_DIR" --tee=3 --local-ranks-filter=0
  -m rlrun train "$CONFIG" "$@")

if [[ ${RLRUN_DRY_RUN:-0} == 1 ]]; then
  echo "${CMD[*]}"
  exit 0
fi
mkdir -p "$LOG_DIR"
# A stop signal (SIGUSR1 before the time limit, SIGTERM) makes the ranks checkpoint and exit 0, but torchrun then
# re-raises the signal it forwarded and exits 1, so the job would read FAILED. When rank 0's log shows the stop
# and the checkpoint after it, the job ends 0 instead (COMPLETED): submitting it again continues.
STARTED="$LOG_DIR/.started-$$"  # a requeued job shares LOG_DIR: read only this run's logs
touch "$STARTED"
rc=0
"${CMD[@]}" || rc=$?
if ((rc != 0)); then
  for log in $(find "$LOG_DIR" -path '*/attempt_*/0/stdout.log' -newer "$STARTED"); do
    if awk '/received: checkpointing and stopping/ {s = 1} s && /checkpoint saved/ {ok = 1} END {exit !ok}' "$log"; then
      echo "[slurm_run] ranks checkpointed and stopped on a signal (torchrun exited $rc); resubmit to continue"
      exit 0
    fi
  done
fi
exit "$rc"
