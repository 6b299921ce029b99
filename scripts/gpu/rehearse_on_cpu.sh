#!/usr/bin/env bash
# Rehearse the SGLang device steps here, on CPU, before spending device time: the GPU suite and the
# train step of scripts/gpu/sglang_device.sh run against the fake sglang (tests/fakes, 0.5.17 mode)
# with a tiny model. Optional first argument: a folder with sglang 0.5.17's transformers/tokenizers set
# (transformers 5.12.1, tokenizers 0.22.2, huggingface_hub 1.x, httpx) installed with pip --target, put
# first on PYTHONPATH as the GPU venv does. Results in /tmp/rehearsal.
#
#   bash scripts/gpu/rehearse_on_cpu.sh [/tmp/tf512]
set -euo pipefail
cd "$(dirname "$0")/../.."
work=/tmp/rehearsal; rm -rf $work; mkdir -p $work/venv
extra=${1:+$1:}
cat > $work/venv/env.sh <<EOF
. $PWD/.venv/bin/activate
export PYTHONPATH=${extra}$PWD/tests/fakes FAKE_SGLANG_VERSION=0.5.17 OMP_NUM_THREADS=1
EOF
. $work/venv/env.sh
RLRUN_SGLANG_SUITE_ON_FAKE=1 SGLANG_GPU_JSON=$work/sglang_gpu_suite.json \
  python -m pytest --noconftest -q -p no:cacheprovider tests/gpu/test_sglang_gpu.py
python scripts/gpu/prepare_model.py $work/model --shape tiny --dtype float32
SGL_VENV=$work/venv OUT=$work/out RLRUN_GPU_MODEL=$work/model bash scripts/gpu/sglang_device.sh train
