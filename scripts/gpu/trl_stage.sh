#!/usr/bin/env bash
# TRL and its dependencies for the GPU machine (no network there), as wheels in pieces under the 64 MiB
# that one device call carries. Order of the calls: scripts/gpu/trl_session.md.
#
#   bash scripts/gpu/trl_stage.sh split            # here: .trl/dl/*.whl -> .trl/p0, .trl/p1, ... (< LIMIT_MIB each)
#   bash scripts/gpu/trl_stage.sh stage .trl/p0    # device: copy one piece's wheels to $TRL_WHL
#   bash scripts/gpu/trl_stage.sh install          # device: install into $TRL_SITE the staged wheels whose
#                                                  # distribution the Python lacks, then import trl
#
# split fills the pieces smallest wheel first, so p0 holds trl, datasets, dill, multiprocess, xxhash and
# every dependency but the largest, pyarrow, which comes alone in p1; the image already has pyarrow 25
# (shared/reference/peer-baseline.md), so p1 is needed only if `install` reports it missing.
# install never replaces what the interpreter has (sglang's venv pins transformers 5.12.1): --no-deps
# into a separate folder that goes last on PYTHONPATH. Python: $TRL_PYTHON, else the sglang venv's
# (/root/sgl/env.sh, as scripts/gpu/sglang_device.sh uses), else python3.
set -euo pipefail
LIMIT_MIB=${LIMIT_MIB:-59}
TRL_WHL=${TRL_WHL:-/root/trl_whl}
TRL_SITE=${TRL_SITE:-/tmp/trl_site}

python_for_device() {
  if [ -n "${TRL_PYTHON:-}" ]; then echo "$TRL_PYTHON"; return; fi
  if [ -f /root/sgl/env.sh ]; then (. /root/sgl/env.sh && command -v python); return; fi
  command -v python3
}

split() {
  rm -rf .trl/p[0-9]*
  python3 - "$LIMIT_MIB" .trl/dl/*.whl <<'PY'
import os, shutil, sys
limit = float(sys.argv[1]) * 2**20
piece, used = 0, 0
for wheel in sorted(sys.argv[2:], key=os.path.getsize):
    size = os.path.getsize(wheel)
    if size > limit:
        sys.exit(f"{wheel} ({size / 2**20:.1f} MiB) must be under LIMIT_MIB ({limit / 2**20:.0f}) because one call carries one piece")
    if used + size > limit:
        piece, used = piece + 1, 0
    os.makedirs(f".trl/p{piece}", exist_ok=True)
    shutil.copy2(wheel, f".trl/p{piece}/")
    used += size
for k in range(piece + 1):
    names = sorted(os.listdir(f".trl/p{k}"))
    total = sum(os.path.getsize(f".trl/p{k}/{n}") for n in names)
    print(f".trl/p{k}: {len(names)} wheels, {total / 2**20:.1f} MiB: {' '.join(n.split('-')[0] for n in names)}")
PY
}

stage() {
  mkdir -p "$TRL_WHL" && cp "$1"/*.whl "$TRL_WHL"/
  echo "staged $(ls "$1"/*.whl | wc -l) wheels from $1; $TRL_WHL holds $(ls "$TRL_WHL"/*.whl | wc -l)"
}

install() {
  py=$(python_for_device)
  export PYTHONPATH=$PWD:/tmp/rlrun_site  # as scripts/gpu/trl_peer.sh runs: rlrun's extras count as present
  missing=$("$py" - "$TRL_WHL"/*.whl <<'PY'
import importlib.metadata as md, sys
for wheel in sys.argv[1:]:
    try:
        md.version(wheel.rsplit("/", 1)[-1].split("-")[0])
    except md.PackageNotFoundError:
        print(wheel)
PY
)
  echo "python: $py; installing into $TRL_SITE: ${missing:-nothing}"
  [ -z "$missing" ] || "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$TRL_SITE" $missing
  PYTHONPATH=$PYTHONPATH:$TRL_SITE "$py" - <<'PY'
import importlib.metadata as md
names = ["trl", "datasets", "accelerate", "transformers", "torch", "pyarrow", "pandas", "xxhash", "dill",
         "multiprocess", "huggingface_hub"]
for n in names:
    try:
        print(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"{n} MISSING: stage the piece that holds it (bash scripts/gpu/trl_stage.sh split lists them)")
from trl import GRPOConfig, GRPOTrainer  # noqa: F401  the import the benchmark needs
print("trl import ok")
PY
}

case "${1:-}" in
  split) split ;;
  stage) stage "$2" ;;
  install) install ;;
  *) echo "usage: $0 split | stage .trl/pN | install" >&2; exit 2 ;;
esac
