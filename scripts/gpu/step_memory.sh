#!/usr/bin/env bash
# Device side of the 4B 64 x 8K bench step's out-of-memory: from the repo root inside
# a device `run` call (one H200), PYTHONPATH at the repo. Each step logs to $OUT/<step>.log, writes its exit code
# to $OUT/steps.txt, and a failed step does not stop the next.
#
#   bash scripts/gpu/step_memory.sh tests quick     # ~4 min: the release GPU test, then 2 steps of 2,048 tokens
#   bash scripts/gpu/step_memory.sh full            # ~8 min: 1 step of 8,192 tokens (the run that died)
#
# Steps:
#   tests  tests/gpu/test_offload_gpu.py: a released embedded engine keeps nothing in torch's allocator (fails
#          on a commit with the WarmBatch reference cycle, passes with it broken)
#   quick  rlrun bench step, qwen3-4b shape, 8 x 8 samples of 2,048 tokens, micro-batch 4, full recompute,
#          cuDNN attention, offload on: per step and placement memory/<placement>/{trainer,engine,device}_gb from
#          metrics.jsonl; with the cycle memory/train/engine_gb is the KV cache (~20 GB), without it ~0.8
#   full   the same at 8,192 tokens (the failed run), 1 step
# Each bench step also writes `rlrun doctor` on its config ($OUT/doctor_<step>.txt): the per-phase estimate
# next to the measured timeline ($OUT/memory_<step>.txt).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

. "$(dirname "$0")/run_steps.sh"  # logged_step

bench() {  # name new_tokens steps limit
    local work=/tmp/step_memory  # the model and prompts are shared; each run copies its metrics out
    logged_step "$1" "$4" "$PY" -m rlrun bench step --shape qwen3-4b --prompts 8 --samples 8 --new-tokens "$2" \
        --steps "$3" --micro-batch-samples 4 --recompute full --packed-attention cudnn_per_sample \
        --work "$work" --out "$OUT/bench_step_qwen3-4b_64x$2.json"
    local run=$work/embedded_cudnn_recompute-full
    cp "$run/metrics.jsonl" "$OUT/metrics_$1.jsonl" 2>/dev/null
    tail -c 20000 "$run/torchrun.log" >"$OUT/torchrun_$1.log" 2>/dev/null
    "$PY" -m rlrun doctor "$run/bench_step.yaml" >"$OUT/doctor_$1.txt" 2>&1
    "$PY" - "$run/metrics.jsonl" >"$OUT/memory_$1.txt" 2>&1 <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    print(f"step {row['step']}: trainer_max_allocated_gb {row.get('memory/trainer_max_allocated_gb')}")
    for placement in ("rollout", "train", "sync"):
        keys = ("trainer_gb", "engine_gb", "device_gb", "trainer_default_pool_reserved_gb")
        print(f"  {placement:8s}", "  ".join(f"{k} {row.get(f'memory/{placement}/{k}')}" for k in keys))
    print("  seconds", {k[5:-2]: round(v, 1) for k, v in row.items() if k.startswith("time/") and k.endswith("_s")})
EOF
}

for name in "${@:-tests quick}"; do
    case $name in
    tests) logged_step tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_offload_gpu.py -rA ;;
    quick) bench quick 2048 2 400 ;;
    full) bench full 8192 1 590 ;;
    *) echo "unknown step $name" >>"$OUT/steps.txt" ;;
    esac
done
