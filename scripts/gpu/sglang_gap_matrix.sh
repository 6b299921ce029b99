#!/usr/bin/env bash
# The trainer-vs-SGLang log-prob gap on the real SmolLM2 in bf16, per SGLang attention backend and
# trainer attention kernel, and with SGLang's rl_on_policy_target (3 steps each, so step 0 and two more). Also the embedded engine against the
# trainer's cudnn_per_sample kernel (not exact by construction: how far off). rl_on_policy_target with torch_native
# attention is left out: SGLang 0.5.17 refuses it at start (deterministic inference takes fa3, fa4, flashinfer, triton).
# Needs the warm machine of scripts/gpu/sglang_device.sh (/root/sgl venv, /tmp/rlrun_site) and SmolLM2 prepared
# (.cache/models/SmolLM2-135M-Instruct). Runs three at a time (mem_fraction_static 0.25 each, started 25 s apart:
# concurrent engines at 0.08 failed to start). About 9 minutes, so give it a device call of its own: on 2026-12-02
# the SGLang runs took 117-265 s each (rl_on_policy_target the longest), and the second wave was still running when
# its call's 600 s ended (benchmarks/results/sglang_gap_matrix_h200.json).
#   bash scripts/gpu/sglang_gap_matrix.sh   # writes $OUT/gap_matrix_*.json and prints one line per run
set -u
OUT=${OUT:-/tmp/gap_matrix}
mkdir -p "$OUT"
G=configs/gpu/smollm2_bf16_colocate.yaml
SA='"mem_fraction_static": 0.25, "sampling_backend": "pytorch", "skip_tokenizer_init": true'
S=(engine.backend=sglang engine.startup_timeout_s=400 offload.colocate=false algorithm.max_logprob_gap=null train.num_steps=3)
run() {  # NAME EXTRA_SERVER_ARGS TRAINER_KERNEL   (EXTRA: a JSON fragment starting with ", " or "")
  timeout 300 python scripts/gpu/onpolicy_bench.py "$OUT/gap_matrix_$1.json" "$1" $G "${S[@]}" \
    "engine.server_args={$SA$2}" "model.packed_attention=$3" > "$OUT/gap_matrix_$1.log" 2>&1 &
  sleep 25
}
TN=', "attention_backend": "torch_native"'
FSDP=', "rl_on_policy_target": "fsdp"'  # SGLang's true on-policy mode: native norms, SiLU, RoPE, log_softmax
start=$(date +%s)
run sgl_torchnative_flash "$TN" flash_varlen  # first: the runs not measured yet
run sgl_default_cudnn "" cudnn_per_sample
run sgl_default_auto "" auto
wait
run sgl_torchnative_auto "$TN" auto
run sgl_fsdp_auto "$FSDP" auto
timeout 300 python scripts/gpu/onpolicy_bench.py "$OUT/gap_matrix_embedded_cudnn.json" embedded_cudnn $G \
  algorithm.max_logprob_gap=null train.num_steps=3 model.packed_attention=cudnn_per_sample \
  > "$OUT/gap_matrix_embedded_cudnn.log" 2>&1
wait
echo "wall $(( $(date +%s) - start )) s"
for f in "$OUT"/gap_matrix_*.json; do python -c "
import json; d=json.load(open('$f'))
for n, r in d['runs'].items(): print(n, {k: r.get(k) for k in ('returncode', 'gap_step0', 'gap_max', 'train_phase_s_median', 'error_lines')})"; done
