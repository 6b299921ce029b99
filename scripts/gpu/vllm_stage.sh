#!/usr/bin/env bash
# vLLM 0.26.0 and TRL 1.16.0 for the GPU machine (no network there), for TRL's GRPOTrainer in vLLM colocate
# mode (a peer benchmarks/peer_step.py compares rlrun with), as wheels in pieces under the 64 MiB one device
# call carries. Order of the calls:
# scripts/gpu/vllm_session.md. Downloading, splitting, staging and joining are verl_stage.sh's, on this list
# and folder (STAGE_LIST, STAGE_PIECES); install and smoke are this environment's own.
#
#   bash scripts/gpu/vllm_stage.sh download          # here (PyPI): scripts/gpu/vllm_wheels.txt -> $VLLM_WHL
#   bash scripts/gpu/vllm_stage.sh split             # here: -> .vllm/p0, .vllm/p1, ... (< LIMIT_MIB each;
#                                                    # the 290 MiB vllm wheel in parts, sha256 per part)
#   bash scripts/gpu/vllm_stage.sh stage .vllm/pK    # device: check one piece, copy it to $VLLM_STAGE
#   bash scripts/gpu/vllm_stage.sh install           # device: join, install every staged wheel into $VLLM_SITE,
#                                                    # write $VLLM_PYTHON
#   bash scripts/gpu/vllm_stage.sh check             # device: versions, unmet requirements, imports, the configs
#   bash scripts/gpu/vllm_stage.sh smoke             # device: vllm.LLM on the tiny random model, as TRL runs it
#
# Its own environment, not SGLang's (vLLM pins flashinfer 0.6.14, apache-tvm-ffi 0.1.10, compressed-tensors
# 0.17.0; SGLang 0.5.17 others): `pip install --target $VLLM_SITE` of all the listed wheels (none is in the
# image), and $VLLM_PYTHON, a launcher of the image's python3 (/opt/torch/.venv: torch 2.11.0+cu130,
# transformers 5.17) with PYTHONPATH=$VLLM_SITE and the repo only, whatever the caller's PYTHONPATH (trl_peer.sh's holds
# SGLang's and rlrun's folders). A venv with --system-site-packages would not see the image's packages:
# the image's python3 is itself a venv.
set -euo pipefail
export STAGE_LIST=scripts/gpu/vllm_wheels.txt STAGE_PIECES=.vllm LIMIT_MIB=${LIMIT_MIB:-55}
export VERL_WHL=${VLLM_WHL:-.whl-vllm} VERL_STAGE=${VLLM_STAGE:-/root/vllm_stage}
VLLM_SITE=${VLLM_SITE:-/tmp/vllm_site}
VLLM_PYTHON=${VLLM_PYTHON:-/root/vllm/python}
BASE_PYTHON=${VLLM_BASE_PYTHON:-/opt/torch/.venv/bin/python3}

install() {
  bash scripts/gpu/verl_stage.sh join
  "$BASE_PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$VLLM_SITE" \
    "$VERL_STAGE"/*.whl
  mkdir -p "$(dirname "$VLLM_PYTHON")"
  cat > "$VLLM_PYTHON" <<LAUNCHER
#!/bin/sh
# The image's Python with vLLM's environment (scripts/gpu/vllm_stage.sh) and nothing of SGLang's.
# SGLang's env.sh activates its venv: the image's bin/ goes first, so tools vLLM starts are the image's.
unset VIRTUAL_ENV
export PATH=$(dirname "$BASE_PYTHON"):\$PATH PYTHONPATH=$VLLM_SITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec $BASE_PYTHON "\$@"
LAUNCHER
  chmod +x "$VLLM_PYTHON"
  echo "installed $(ls "$VERL_STAGE"/*.whl | wc -l) wheels into $VLLM_SITE; python: $VLLM_PYTHON"
}

check() {  # versions; what vLLM and TRL ask for that this environment lacks or has at another version; imports
  "$VLLM_PYTHON" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
for n in ["vllm", "trl", "torch", "transformers", "tokenizers", "datasets", "accelerate", "pydantic", "xgrammar",
          "numba", "protobuf", "aiohttp", "triton"]:
    try:
        print(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"{n} MISSING")
for dist in ("vllm", "trl"):  # informational: --no-deps never enforced these
    unmet = []
    for spec in md.requires(dist) or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{req.name} (absent)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req.name} {have} (wants {req.specifier})")
    print(f"{dist} requirements not met ({len(unmet)}): {', '.join(unmet)}")
import vllm  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
import vllm.v1.engine.core, vllm.v1.worker.gpu_model_runner, vllm.model_executor.models.qwen3  # noqa: F401,E401
import vllm.v1.attention.backends.flash_attn, vllm.device_allocator.cumem  # noqa: F401,E401
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
from trl.import_utils import is_vllm_available
print(f"vllm import ok; trl sees vllm: {is_vllm_available()}")
PY
  for offload in on off; do
    "$VLLM_PYTHON" benchmarks/trl_grpo.py --use-vllm --offload $offload --check-config --work /tmp/vllm_check
  done
}

case "${1:-}" in
  download | split | stage) bash scripts/gpu/verl_stage.sh "$@" ;;
  install) install ;;
  check) check ;;
  smoke) "$VLLM_PYTHON" scripts/gpu/vllm_smoke.py ;;
  *) echo "usage: $0 download | split | stage .vllm/pN | install | check | smoke" >&2; exit 2 ;;
esac
