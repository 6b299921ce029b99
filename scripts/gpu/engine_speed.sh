#!/usr/bin/env bash
# Device side of the embedded engine's speed against SGLang's, from the repo root inside a device `run`
# call (one H200), PYTHONPATH at the repo and the wheels installed. Each step logs to $OUT/<step>.log, writes
# its exit code to $OUT/steps.txt, and a failed step does not stop the next.
#
#   bash scripts/gpu/engine_speed.sh tests bench_qwen3-0.6b                       # call 1: embedded (~4 min)
#   bash scripts/gpu/engine_speed.sh bench_qwen3-1.7b                             # call 2 (~5 min)
#   BACKENDS=embedded,sglang bash scripts/gpu/engine_speed.sh bench_qwen3-0.6b    # with SGLang importable (~8 min)
#   bash scripts/gpu/engine_speed.sh profile_qwen3-0.6b                           # where a decode step goes (~2 min)
#   bash scripts/gpu/engine_speed.sh tail_qwen3-0.6b                              # the long tail, shrunk vs whole
#
# Steps:
#   tests       the GPU tests of the decode: the chunked kernels (split decode and prefill bitwise the trainer's
#               chunked forward, its gradients; the trainer's core attention classes), by key counts bitwise vs the trainer's forward and the masked path,
#               read-length buckets bitwise vs the whole cache, chunked prefill bitwise, graphs kept warm, routed
#               experts in the captured step, the shared QK-norm (both sides' layouts bitwise, a tiny Qwen3's run at
#               the gate), engine-vs-trainer exactness (tests/gpu), the sampler's shortcuts bitwise (bf16 logits,
#               tabulated noise, no unread full-vocabulary draw)
#   bench_qwen3-0.6b  rlrun bench rollout, qwen3-0.6b shape, batch 64 and 128: greedy, sampled and the long-tail
#   bench_qwen3-1.7b  call (docs/engine.md "Measuring it") -> $OUT/bench_rollout_<shape>.json; both shapes in one run:
#               bench_qwen3-0.6b,qwen3-1.7b with BENCH_TIMEOUT_S=1200 under scripts/gpu/background.sh (~12 minutes)
#   tail_<shape>  scripts/engine_refill_steps.py at batch 64 and 128 (the bench's long-tail call, in process, embedded
#               only): counted and timed with the tail in smaller batches and kept whole -> $OUT/tail_<shape>_b<batch>.json
#   profile_<shape>   rlrun bench rollout --profile at batch 64 (in process, with HF generate): the kernel-time
#               table of decode steps of the sampled call -> $OUT/decode_profile_<shape>_b64.txt, the JSON (its
#               decode_profile: busy fraction, time per step by category, host gap, HBM bound) -> .json; printed
#
# CPU rehearsal of the tail step: OUT=/tmp/es DEVICE=cpu BATCH=16 LONG_TAIL_MAX=64 bash scripts/gpu/engine_speed.sh tail_tiny
# CPU rehearsal of the bench step (tiny shape, float32): OUT=/tmp/es BATCH=4,8 NEW_TOKENS=16 LONG_TAIL_MAX=64 \
#   bash scripts/gpu/engine_speed.sh bench_tiny
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
BACKENDS=${BACKENDS:-embedded}
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

. "$(dirname "$0")/run_steps.sh"  # logged_step

bench() {  # $1: one shape, or several comma-separated (one run; past a call's 10 minutes: BENCH_TIMEOUT_S, background.sh)
    local name=${1//,/_}
    logged_step "bench_$name" "${BENCH_TIMEOUT_S:-540}" "$PY" -m rlrun bench rollout --shape "$1" --backends "$BACKENDS" \
        --batch "${BATCH:-64,128}" --prompt-len 128 --new-tokens "${NEW_TOKENS:-256}" --long-tail \
        --long-tail-max "${LONG_TAIL_MAX:-1024}" --run-dir /tmp/rlrun-bench --out "$OUT/bench_rollout_$name.json"
}

profile() {
    local base="$OUT/decode_profile_$1_b64"
    # bench rollout's in-process engine takes the worker's cuBLAS setting itself (EXACT_GEMM_ENV, rlrun/tools/bench/rollout.py)
    logged_step "profile_$1" 280 "$PY" -m rlrun bench rollout --shape "$1" --batch 64 --prompt-len 128 --new-tokens 256 \
        --profile "$base.txt" --out "$base.json"
    head -n 45 "$base.txt" | cut -c1-190
    "$PY" -c 'import json, sys; r = json.load(open(sys.argv[1]))["results"][0]
print({k: round(r[k]["tokens_per_s"]) for k in ("engine", "engine_sampled", "hf_generate")})
print(json.dumps(r["decode_profile"], indent=1))' "$base.json"
}

tail_ab() {
    local batch
    local batches=${BATCH:-64,128}
    for batch in ${batches//,/ }; do
        logged_step "tail_$1_b$batch" 280 "$PY" scripts/engine_refill_steps.py --shape "$1" --device "${DEVICE:-cuda}" \
            --prompt-len 128 --slots "$batch" --median 128 --max-new-tokens "${LONG_TAIL_MAX:-1024}" \
            --out "$OUT/tail_$1_b$batch.json"
    done
}

for name in "${@:-tests bench_qwen3-0.6b bench_qwen3-1.7b}"; do
    for one in $name; do
        case $one in
        tests) logged_step tests 480 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_chunked_attention_gpu.py \
            tests/gpu/test_attention_gpu.py tests/gpu/test_decode_attention_gpu.py \
            tests/gpu/test_decode_buckets_gpu.py tests/gpu/test_chunked_prefill_gpu.py tests/gpu/test_routing_gpu.py \
            tests/gpu/test_head_norm_gpu.py tests/gpu/test_hidden_norm_gpu.py tests/gpu/test_onpolicy_gpu.py \
            tests/unit/test_engine_embedded.py tests/unit/test_engine_sampling.py \
            tests/gpu/test_triton_kernels_gpu.py::test_the_greedy_pick_is_the_first_argmax_and_its_log_softmax ;;
        bench_*) bench "${one#bench_}" ;;
        tail_*) tail_ab "${one#tail_}" ;;
        profile_*) profile "${one#profile_}" ;;
        *) echo "unknown step $one" >&2; exit 2 ;;
        esac
    done
done
cat "$OUT/steps.txt"
