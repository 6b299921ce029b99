#!/usr/bin/env bash
# Device side of the step against peers: rlrun (embedded and sglang engines) vs TRL GRPOTrainer and verl, one shape
# per call, all runs in one invocation of benchmarks/peer_step.py. Needs a warm machine where
# scripts/gpu/sglang_device.sh install and scripts/gpu/trl_stage.sh install have run (trl_session.md), and
# for verl scripts/gpu/verl_stage.sh install (verl_session.md).
#
#   bash scripts/gpu/trl_peer.sh qwen3-0.6b [STEPS] [BACKENDS]     # -> $OUT/peer_step_<shape>.json + logs
#
# BACKENDS: rlrun variants, comma-separated: embedded, sglang, each optionally with _resident (offload off),
# _keepnccl (NCCL teardown off), _varlen or _persample (packed attention; default auto) and _headkept
# (model.lm_head: chunked_kept), e.g. sglang,sglang_keepnccl,sglang_resident_varlen,sglang_resident_headkept
# (peer_step.py parse_variant lists them all); `none` runs no rlrun variant.
# VERL=verl,verl_resident runs benchmarks/verl_grpo.py with offload on / off (peer_step.py --verl).
# TRL_VLLM=trl_vllm,trl_vllm_resident runs benchmarks/trl_grpo.py --use-vllm with vLLM's sleep mode on / off
# (peer_step.py --trl-vllm) under $VLLM_PYTHON (scripts/gpu/vllm_stage.sh install writes it).
# OUT_NAME=x names the JSON peer_step_<shape>_x.json (a second call on the same shape, e.g. with
# PEER_ARGS="--reuse-trl", which takes TRL's figures from the first call's /tmp/peer_<shape>/trl.json).
#
# PEER_ARGS adds peer_step.py flags (e.g. "--prompts 2 --new-tokens 6" for a dry run on CPU against the
# sglang fake: SGL_VENV pointing at a folder whose env.sh activates a Python with trl and puts
# tests/fakes on PYTHONPATH).
#
# The sglang venv's Python runs everything (rlrun's extras from /tmp/rlrun_site, TRL from /tmp/trl_site, verl
# from /tmp/verl_site, all after the venv's own packages). The whole script stays under the 600 s a call may take, so the
# logs always come back; peer_step.py rewrites its JSON after every run, so a run cut short keeps the others.
# PEER_TIMEOUT_S (default 560) is that limit; under scripts/gpu/background.sh, which outlives a call, set it to the
# whole invocation's budget (verl_session.md, "One invocation").
set -uo pipefail
SHAPE=${1:?usage: trl_peer.sh SHAPE [STEPS] [BACKENDS]}
STEPS=${2:-4}
BACKENDS=${3:-embedded,sglang}
[ "$BACKENDS" = none ] && BACKENDS=
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
VENV=${SGL_VENV:-/root/sgl}
[ -f $VENV/env.sh ] || { echo "no $VENV/env.sh: run sglang_device.sh install first (machine cold?)"; exit 1; }
. $VENV/env.sh
export PYTHONPATH=$PWD:/tmp/rlrun_site${PYTHONPATH:+:$PYTHONPATH}:/tmp/trl_site:/tmp/verl_site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=/tmp/peer_$SHAPE
VERL=${VERL:-}
TRL_VLLM=${TRL_VLLM:-}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null
timeout "${PEER_TIMEOUT_S:-560}" python benchmarks/peer_step.py --shape "$SHAPE" --steps "$STEPS" --backends "$BACKENDS" \
  --work "$WORK" --timeout-s 240 --verl "$VERL" --trl-vllm "$TRL_VLLM" \
  --trl-vllm-python "${VLLM_PYTHON:-/root/vllm/python}" --out "$OUT/peer_step_$SHAPE${OUT_NAME:+_$OUT_NAME}.json" \
  ${PEER_ARGS:-}; rc=$?
logs="$WORK/trl.log"
for b in ${BACKENDS//,/ }; do logs="$logs $WORK/rlrun_$b.log"; done
for v in ${VERL//,/ } ${TRL_VLLM//,/ }; do logs="$logs $WORK/$v.log"; done
for log in $logs; do
  [ -f "$log" ] && tail -c 20000 "$log" > "$OUT/$(basename "$log")"
done
for v in ${VERL//,/ }; do  # verl's own output (main_ppo and its Ray workers), next to verl_grpo.py's
  [ -f "$WORK/$v/verl.log" ] && tail -c 20000 "$WORK/$v/verl.log" > "$OUT/${v}_main_ppo.log"
done
tail -n 40 "$WORK"/sglang/engine-*.log > "$OUT/sglang_engine_tail.log" 2>/dev/null
echo "peer_step rc=$rc"
exit $rc
