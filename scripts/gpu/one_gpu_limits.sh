#!/usr/bin/env bash
# Device side of the one-GPU-limits rows (benchmarks/one_gpu_limits.py reads what this writes): from the repo root
# inside a device `run` call, PYTHONPATH at the repo and the wheels installed. Each step logs to $OUT/<step>.log,
# writes "<step> <rc>" to $OUT/steps.txt, and a failed step does not stop the next. JSON names are the ones
# benchmarks/one_gpu_limits.py globs for; copy them into benchmarks/results/ with the card's suffix.
#
#   bash scripts/gpu/one_gpu_limits.sh rollout step_resident step_offload sync sleep_wake    # ~9 min on an H200
#
# Steps:
#   rollout        rlrun bench rollout, qwen3-1.7b, embedded worker, batch 64 and 128, 128 + 256 tokens: fraction of the
#                  HBM bound (weights + K/V at the mean context, the card's bandwidth)
#   step_resident  rlrun bench step, qwen3-1.7b, 16 x 8 x (128 + 512), embedded, resident, LM head kept, 4 steps
#   step_offload   the same with offload (trainer and engine take turns)
#   step_fast      step_resident with the fastest attention that is not exact (flash_varlen): the exact path's cost
#   mfu_4b         rlrun bench train, qwen3-4b, 2 samples of 32K tokens, full recompute, the exact kernel (auto)
#   sync           rlrun bench sync, qwen3-8b, embedded, 512 MiB buckets
#   sleep_wake     rlrun bench step, qwen3-0.6b, embedded, offload, LM head kept, 4 steps: offload/trainer_{sleep,wake}_s
#
# MICRO (default 32) is the samples of a training micro-batch; 8 fits the 1.7B offload step on an 80 GB card.
#
# CPU rehearsal (tiny shape, small work): OUT=/tmp/lim SHAPE_17=tiny SHAPE_8=tiny SHAPE_06=tiny PROMPTS=2 SAMPLES=2 \
#   NEW_TOKENS=8 HBM_GBPS=1000 bash scripts/gpu/one_gpu_limits.sh rollout step_resident step_offload sync sleep_wake
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
S17=${SHAPE_17:-qwen3-1.7b} S8=${SHAPE_8:-qwen3-8b} S06=${SHAPE_06:-qwen3-0.6b}
HBM=()
[ -n "${HBM_GBPS:-}" ] && HBM=(--hbm-gbps "$HBM_GBPS")

. "$(dirname "$0")/run_steps.sh"  # logged_step

step() {  # name shape offload limit [attention]
    logged_step "$1" "$4" "$PY" -m rlrun bench step --shape "$2" --backend embedded --offload "$3" --lm-head chunked_kept \
        --packed-attention "${5:-auto}" --micro-batch-samples "${MICRO:-32}" \
        --prompts "${PROMPTS:-16}" --samples "${SAMPLES:-8}" --new-tokens "${NEW_TOKENS:-512}" --steps 4 \
        --work "/tmp/limits_$2" --out "$OUT/one_gpu_limits_step_$1.json"
}

for name in "$@"; do
    case $name in
    rollout) logged_step rollout 200 "$PY" -m rlrun bench rollout --shape "$S17" --backends embedded --batch 64,128 \
        --prompt-len 128 --new-tokens "${ROLLOUT_NEW_TOKENS:-256}" "${HBM[@]}" --run-dir /tmp/limits_rollout \
        --out "$OUT/one_gpu_limits_rollout.json" ;;
    step_resident) step step_resident "$S17" off 150 ;;
    step_offload) step step_offload "$S17" on 170 ;;
    step_fast) step step_fast "$S17" off 150 flash_varlen ;;
    mfu_4b) logged_step mfu_4b 200 "$PY" -m rlrun bench train --shape "${SHAPE_4:-qwen3-4b}" --layout packed \
        --samples-per-micro-batch 1 --micro-batches 2 --steps 3 --sample-len "${SAMPLE_LEN:-32768}" --recompute full \
        --packed-attention auto --out "$OUT/one_gpu_limits_mfu_4b.json" ;;
    sync) logged_step sync 150 "$PY" -m rlrun bench sync --shape "$S8" --run-dir /tmp/limits_sync \
        --out "$OUT/one_gpu_limits_sync.json" ;;
    sleep_wake) step sleep_wake "$S06" on 120 ;;
    *) echo "unknown step $name" >>"$OUT/steps.txt" ;;
    esac
    tail -n 3 "$OUT/$name.log"
done
cat "$OUT/steps.txt"
