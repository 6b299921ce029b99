#!/usr/bin/env bash
# Device side of the SGLang backend on a GPU (install, tests, train, bench), run from the repo root inside a
# device `run` call.
# Steps run in the order given; each has its own timeout, its log in $OUT/<step>.log, and its exit code
# in $OUT/steps.txt; a failed step does not stop the next. Order and carry lists: scripts/gpu/sglang_session.md.
#
#   bash scripts/gpu/sglang_device.sh install env suite # the call that carries .sgl/c05 + .sgl/tools + .whl
#   bash scripts/gpu/sglang_device.sh train             # later calls, machine still warm
#   bash scripts/gpu/sglang_device.sh bench
#
# Steps:
#   install  stage the last piece (.sgl/c05), run .sgl/tools/install.sh (venv /root/sgl), then add what
#            rlrun needs and the venv lacks (megatron-core, pytest, ... from .whl) into /tmp/rlrun_site
#   env      import check of rlrun's deps under the venv's Python -> $OUT/env.json
#   suite    tests/gpu/test_sglang_gpu.py -> $OUT/sglang_gpu_suite.json + junit XML
#   train    3 colocated GRPO steps, configs/gpu/sglang_colocate.yaml -> $OUT/train_summary.json
#   bench    rlrun bench rollout / sync, embedded and sglang side by side -> $OUT/bench_*.json
# RLRUN_SGLANG_EXTRA_SERVER_ARGS (JSON, e.g. '{"disable_cuda_graph": true}') adds sglang.Engine arguments
# to the suite's and the train step's.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=/tmp/rlrun_site
VENV=${SGL_VENV:-/root/sgl}
MODEL=${RLRUN_GPU_MODEL:-/root/models/qwen3-0.6b-random}

activate() {  # the sglang venv, then rlrun (repo) and the extras it lacks; fails if install has not run
  [ -f $VENV/env.sh ] || { echo "no $VENV/env.sh: run the install step first (machine cold?)"; return 1; }
  . $VENV/env.sh
  export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
}

step_install() {
  # the last pieces, when this call carries them (the earlier calls staged the others)
  pieces=$(ls -d .sgl/c[0-9][0-9] 2>/dev/null || true)
  [ -z "$pieces" ] || bash .sgl/tools/stage.sh $pieces || return 1
  bash .sgl/tools/install.sh || return 1
  . $VENV/env.sh
  # only wheels whose distribution the venv (or the image under it) lacks: never shadow sglang's pins
  wheels=$(ls .whl/*.whl 2>/dev/null || ls /root/rlrun_whl/*.whl)  # /root/rlrun_whl: staged by an earlier call
  missing=$(python - $wheels <<'EOF'
import importlib.metadata as md, sys
for wheel in sys.argv[1:]:
    try:
        md.version(wheel.rsplit("/", 1)[-1].split("-")[0])
    except md.PackageNotFoundError:
        print(wheel)
EOF
)
  echo "installing into $SITE: $missing"
  [ -z "$missing" ] || python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $missing
}

step_env() {
  activate || return 1
  python - "$OUT/env.json" <<'EOF'
import importlib, importlib.metadata as md, json, sys
out = {"python": sys.executable, "versions": {}, "errors": {}}
for module, dist in [("torch", "torch"), ("sglang", "sglang"), ("transformers", "transformers"),
                     ("megatron.core", "megatron-core"), ("zmq", "pyzmq"), ("pydantic", "pydantic"),
                     ("torch_memory_saver", "torch_memory_saver"), ("msgpack", "msgpack"), ("typer", "typer"),
                     ("safetensors", "safetensors"), ("yaml", "pyyaml"), ("rich", "rich"), ("pytest", "pytest"),
                     ("rlrun.megatron", None), ("rlrun.engine.worker", None)]:
    try:
        mod = importlib.import_module(module)
        out["versions"][module] = md.version(dist) if dist else mod.__file__
    except Exception as exc:
        out["errors"][module] = repr(exc)
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out))
sys.exit(1 if out["errors"] else 0)
EOF
}

step_suite() {
  activate || return 1
  SGLANG_GPU_JSON=$OUT/sglang_gpu_suite.json timeout 420 python -m pytest -q -s -p no:cacheprovider \
    --junitxml "$OUT/sglang_gpu_suite.xml" tests/gpu/test_sglang_gpu.py
}

step_train() {
  activate || return 1
  [ -f $MODEL/config.json ] || python scripts/gpu/prepare_model.py $MODEL || return 1
  config=configs/gpu/sglang_colocate.yaml
  if [ -n "${RLRUN_SGLANG_EXTRA_SERVER_ARGS:-}" ]; then  # same extra server args as the suite, e.g. no CUDA graphs
    python -c 'import json, os, sys, yaml; c = yaml.safe_load(open(sys.argv[1])); c["engine"]["server_args"].update(json.loads(os.environ["RLRUN_SGLANG_EXTRA_SERVER_ARGS"])); yaml.safe_dump(c, open(sys.argv[2], "w"))' $config /tmp/sglang_colocate.yaml || return 1
    config=/tmp/sglang_colocate.yaml
  fi
  # python -m torch.distributed.run, not `torchrun`: that script's shebang is the image's Python, whose ranks
  # (and their engine workers, started with sys.executable) would not see the sglang venv
  timeout 400 python -m torch.distributed.run --standalone --nproc-per-node 1 -m rlrun train $config \
    --set model.path=$MODEL --set logging.run_dir=/tmp/runs/sglang_colocate; rc=$?
  cp /tmp/runs/sglang_colocate/engine-*.log "$OUT/" 2>/dev/null
  python scripts/gpu/summarise_train.py /tmp/runs/sglang_colocate "$OUT/train_summary.json"
  return $rc
}

step_bench() {
  activate || return 1
  timeout 240 python -m rlrun bench rollout --shape qwen3-0.6b --backends embedded,sglang --run-dir /tmp/runs/bench \
    --out "$OUT/bench_rollout_qwen3-0.6b_embedded_sglang.json" > /dev/null; rc=$?
  timeout 300 python -m rlrun bench sync --shape qwen3-0.6b --backends embedded,sglang --run-dir /tmp/runs/bench \
    --out "$OUT/bench_sync_qwen3-0.6b_embedded_sglang.json" > /dev/null || rc=$?
  cp /tmp/runs/bench/engine-*.log "$OUT/" 2>/dev/null
  return $rc
}

. "$(dirname "$0")/run_steps.sh"
run_steps "$@"
