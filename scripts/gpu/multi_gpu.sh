#!/usr/bin/env bash
# Device side of multi-GPU training on one host, run from the repo root inside a device `run` call on
# nvidia-h200-x2 (or x4/x8). Steps run in the order given; each has its own timeout, its log in
# $OUT/<step>.log and its exit code in $OUT/steps.txt; a failed step does not stop the next.
# Calls, carry lists and what changes for x4/x8: scripts/gpu/multi_gpu_session.md.
#
#   bash scripts/gpu/multi_gpu.sh install prepare baseline tp2 dp2 summary   # call 1 (carry .whl)
#   bash scripts/gpu/multi_gpu.sh pp2 engine_tp2 summary                      # call 2 (carry .whl)
#   bash scripts/gpu/multi_gpu.sh scaling                                     # call 3 (carry .whl)
#
# Steps:
#   install     the wheels the image lacks (.whl: megatron-core, pyzmq, pydantic, ...) into /tmp/site
#   prepare     the random Qwen3-0.6B-shaped model (scripts/gpu/prepare_model.py) in $MODEL
#   baseline    TP=1 DP=1 on one GPU: 3 colocated GRPO steps (offload on, embedded engine), every
#               step's samples saved (debug.save_rollout_data) so the layouts train on the same data
#   tp2 dp2 pp2 the same 3 steps on 2 GPUs at TP=2 / DP=2 / PP=2, reading the baseline's samples
#               (debug.load_rollout_data): same data, same seed, so their step-0 loss must match
#   tp2dp2 tp2pp2 (x4) and tp2pp2dp2 (x8): the same on 4 / 8 GPUs
#   engine_tp2  trainer TP=2 and engine.tp=2 on 2 GPUs, generating its own samples: after each sync
#               (steps 1, 2) train/logprob_gap is the engine-vs-trainer gap of the synced weights
#   engine_tp2_sglang  the same with engine.backend=sglang: ONE SGLang engine sharded over both GPUs
#               (tp_size 2), one CUDA-IPC payload per engine TP rank; needs the sglang venv
#               (/root/sgl, sglang_session.md calls 1-5 and `bash scripts/gpu/sglang_device.sh install`)
#   summary     scripts/gpu/summarise_multi_gpu.py layouts -> $OUT/multi_gpu_layouts.json
#   scaling     `rlrun bench step` (rlrun/tools/bench/step.py bench_step) at 1 rank and at each of $SCALE_RANKS
#               (default 2), SCALE_SETTINGS' prompts per rank -> $OUT/weak_scaling.json (efficiency t(1)/t(N))
# A layout step on a machine that lost the baseline (cold start) runs prepare and baseline first.
#
# CPU rehearsal (gloo, the tiny shape in float32, the repo's venv): RLRUN_MULTI_GPU_CPU=1, e.g.
#   RLRUN_MULTI_GPU_CPU=1 OUT=/tmp/mg bash scripts/gpu/multi_gpu.sh prepare baseline tp2 dp2 pp2 engine_tp2 summary scaling
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1
CPU=${RLRUN_MULTI_GPU_CPU:-0}
RUNS=${RLRUN_MULTI_GPU_RUNS:-/tmp/runs/multi_gpu}
SCALE_RANKS=${SCALE_RANKS:-2}
if [ "$CPU" = 1 ]; then
  MODEL=${RLRUN_GPU_MODEL:-$RUNS/model}; SHAPE=tiny; DTYPE=float32; TRAIN_TIMEOUT=300
  export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
  SIZE=(rollout.prompts_per_step=4 rollout.samples_per_prompt=4 rollout.max_new_tokens=6 optimizer.lr=1e-3)
  SCALE_SETTINGS='{"shape": "tiny", "prompts": 2, "samples": 4, "prompt_len": 8, "new_tokens": 6, "steps": 3,
                   "micro_batch_samples": 4}'
else
  MODEL=${RLRUN_GPU_MODEL:-/root/models/qwen3-0.6b-random}; SHAPE=qwen3-0.6b; DTYPE=bfloat16; TRAIN_TIMEOUT=170
  SIZE=(rollout.prompts_per_step=8 rollout.samples_per_prompt=8 rollout.max_new_tokens=64 optimizer.lr=1e-6
        train.max_tokens_per_micro_batch=8192)
  SCALE_SETTINGS='{"shape": "qwen3-0.6b", "prompts": 16, "samples": 8, "prompt_len": 128, "new_tokens": 512,
                   "steps": 4, "micro_batch_samples": 32}'
fi
# One config for every layout: quickstart.yaml's data and GRPO settings on the random model, 3 steps,
# colocated with offload on; an entropy bonus makes the step-0 loss depend on the model's numerics (the
# policy term at step 0 has ratio 1 in every layout), and a reward on token ids gives every group spread.
# RLRUN_MULTI_GPU_SETS adds KEY=VALUE pairs to every run (e.g. offload.teardown_nccl=false for a retry).
COMMON=(model.path=$MODEL model.dtype=$DTYPE train.num_steps=3 offload.colocate=true "${SIZE[@]}"
        rollout.reward=rlrun.tools.bench.step:even_token_reward rollout.ignore_eos=true
        algorithm.skip_tied_groups=false algorithm.entropy_coef=0.01 checkpoint.save_interval=0
        ${RLRUN_MULTI_GPU_SETS:-})

activate() {  # the repo and the wheels on PYTHONPATH (GPU: installs them when the machine is fresh)
  if [ "$CPU" = 1 ]; then . .venv/bin/activate; export PYTHONPATH=$PWD; return; fi
  [ -d /tmp/site/megatron ] || step_install || return 1
  export PYTHONPATH=/tmp/site:$PWD
}

step_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
}

step_prepare() {
  activate || return 1
  [ -f "$MODEL/config.json" ] || python3 scripts/gpu/prepare_model.py "$MODEL" --shape $SHAPE --dtype $DTYPE
}

train() {  # NAME NPROC KEY=VALUE...: `rlrun train` under torchrun with COMMON and the layout's settings
  local name=$1 nproc=$2; shift 2
  local sets=() kv config=${CONFIG:-configs/quickstart.yaml}
  for kv in "${COMMON[@]}" logging.run_dir=$RUNS/$name "$@"; do sets+=(--set "$kv"); done
  rm -rf "${RUNS:?}/$name"
  echo "rlrun train $config (nproc $nproc) ${sets[*]}"
  # python -m torch.distributed.run: the same Python for the ranks and their engine workers
  timeout $TRAIN_TIMEOUT python3 -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    -m rlrun train "$config" "${sets[@]}"
}

layout() {  # NAME NPROC KEY=VALUE...: a layout trained on the baseline's saved samples
  activate || return 1
  [ -f "$RUNS/baseline/metrics.jsonl" ] || { step_prepare && step_baseline; } || return 1
  train "$@" debug.load_rollout_data=$RUNS/baseline/debug
}

step_baseline() { activate && step_prepare && train baseline 1 debug.save_rollout_data=true; }
step_tp2() { layout tp2 2 parallel.tp=2; }
step_dp2() { layout dp2 2; }
step_pp2() { layout pp2 2 parallel.pp=2; }
step_tp2dp2() { layout tp2dp2 4 parallel.tp=2; }
step_tp2pp2() { layout tp2pp2 4 parallel.tp=2 parallel.pp=2; }
step_tp2pp2dp2() { layout tp2pp2dp2 8 parallel.tp=2 parallel.pp=2; }
step_engine_tp2() { activate && step_prepare && train engine_tp2 2 parallel.tp=2 engine.tp=2; }
step_engine_tp2_sglang() {  # sglang_colocate.yaml brings the SGLang server args (KV from 30% of each GPU)
  step_prepare && activate_sglang || return 1  # (prepare re-activates the plain environment)
  CONFIG=configs/gpu/sglang_colocate.yaml TRAIN_TIMEOUT=400 \
    train engine_tp2_sglang 2 parallel.tp=2 engine.tp=2 engine.backend=sglang
}

activate_sglang() {  # GPU: the sglang venv of sglang_device.sh install; CPU: the fake sglang (0.5.17)
  if [ "$CPU" = 1 ]; then activate && export PYTHONPATH=$PWD/tests/fakes:$PYTHONPATH FAKE_SGLANG_VERSION=0.5.17; return; fi
  [ -f /root/sgl/env.sh ] || { echo "no /root/sgl/env.sh: stage sglang first (scripts/gpu/sglang_session.md calls 1-5, then bash scripts/gpu/sglang_device.sh install)"; return 1; }
  . /root/sgl/env.sh
  export PYTHONPATH=$PWD:/tmp/rlrun_site${PYTHONPATH:+:$PYTHONPATH}
}

step_summary() {
  activate || return 1
  python3 scripts/gpu/summarise_multi_gpu.py layouts "$RUNS" "$OUT/multi_gpu_layouts.json"
}

step_scaling() {
  activate || return 1
  local rc=0 n
  # python -c, not a heredoc: bench step writes its inputs in a spawned process, which re-imports __main__
  local bench='
import dataclasses, json, sys
from pathlib import Path
from rlrun.tools.bench.step import StepSettings, bench_step
ranks, work, per_rank = int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
settings = StepSettings(**{**per_rank, "prompts": per_rank["prompts"] * ranks})  # the same prompts per rank
result = bench_step(settings, work, timeout_s=270, ranks=ranks)
(work / f"bench_step_ranks{ranks}.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
print(f"ranks {ranks}: median {result.median_step_s:.3f} s/step, {result.samples_per_rank} samples per rank")'
  rm -rf "$RUNS/scaling"
  for n in 1 $SCALE_RANKS; do  # summarised after every run: a call cut short keeps what finished
    python3 -c "$bench" "$n" "$RUNS/scaling" "$SCALE_SETTINGS" || rc=$?
    python3 scripts/gpu/summarise_multi_gpu.py scaling "$OUT/weak_scaling.json" "$RUNS"/scaling/bench_step_ranks*.json || rc=$?
  done
  return $rc
}

. "$(dirname "$0")/run_steps.sh"
run_steps "$@"
