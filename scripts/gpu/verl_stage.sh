#!/usr/bin/env bash
# verl 0.9.1 and its dependencies for the GPU machine (no network there), as wheels in pieces under the 64 MiB
# that one device call carries. Order of the calls: scripts/gpu/verl_session.md.
#
#   bash scripts/gpu/verl_stage.sh download         # here (PyPI): scripts/gpu/verl_wheels.txt -> $VERL_WHL
#   bash scripts/gpu/verl_stage.sh split            # here: $VERL_WHL/*.whl -> .verl/p0, .verl/p1, ... (< LIMIT_MIB each)
#   bash scripts/gpu/verl_stage.sh stage .verl/p0   # device: check one piece and copy it to $VERL_STAGE
#   bash scripts/gpu/verl_stage.sh install          # device: join split wheels, install the staged wheels whose
#                                                   # distribution the Python lacks into $VERL_SITE, check
#                                                   # (CHECK=0: no check, ~1 minute less, for a session whose
#                                                   # benchmark itself would show a broken install)
#
# download, split, stage and join also serve scripts/gpu/vllm_stage.sh: STAGE_LIST names the wheel list,
# STAGE_PIECES the folder of the pieces, VERL_WHL / VERL_STAGE the wheel folders here and there.
# A wheel larger than a piece (ray, 76 MiB) is cut into parts, each a file of its own with its own checksum;
# WHEELS in every piece lists the whole wheels' sha256, so install verifies each joined wheel.
# install never replaces what the interpreter has (sglang's venv pins transformers 5.12.1, which verl 0.9.1
# runs under although its metadata says <5.11: scripts/gpu/verl_session.md): --no-deps into a separate
# folder that goes last on PYTHONPATH. verl's and TransferQueue's wheels also ship top-level `tests`,
# `scripts`, `recipe` and `tutorial` packages; install deletes them, since a `tests` package there would
# shadow the repo's own tests folder. Python: $VERL_PYTHON, else the sglang venv's (/root/sgl/env.sh),
# else python3.
set -euo pipefail
LIMIT_MIB=${LIMIT_MIB:-52}
VERL_WHL=${VERL_WHL:-.whl-verl}
VERL_STAGE=${VERL_STAGE:-/root/verl_stage}
VERL_SITE=${VERL_SITE:-/tmp/verl_site}
STAGE_LIST=${STAGE_LIST:-scripts/gpu/verl_wheels.txt}
STAGE_PIECES=${STAGE_PIECES:-.verl}

python_for_device() {
  if [ -n "${VERL_PYTHON:-}" ]; then echo "$VERL_PYTHON"; return; fi
  if [ -f /root/sgl/env.sh ]; then (. /root/sgl/env.sh && command -v python); return; fi
  command -v python3
}

download() {  # binary wheels for the device's Python (glibc 2.39); the sdist-only ones built here (pure Python)
  mkdir -p "$VERL_WHL"
  grep -v '^#' "$STAGE_LIST" | awk 'NF && $2 != "sdist" {print $1}' > "$VERL_WHL/specs.txt"
  PIP_CONSTRAINT= python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform any -d "$VERL_WHL" -r "$VERL_WHL/specs.txt"
  sdists=$(grep -v '^#' "$STAGE_LIST" | awk '$2 == "sdist" {print $1}')
  [ -z "$sdists" ] || PIP_CONSTRAINT= python3 -m pip wheel -q --no-deps -w "$VERL_WHL" $sdists
  rm "$VERL_WHL/specs.txt"
  ls "$VERL_WHL"/*.whl | wc -l; du -sh "$VERL_WHL"
}

split() {
  rm -rf "$STAGE_PIECES"/p[0-9]*
  python3 - "$LIMIT_MIB" "$STAGE_PIECES" "$VERL_WHL"/*.whl <<'PY'
import hashlib, os, sys
limit = int(float(sys.argv[1]) * 2**20)
wheels = sys.argv[3:]
sums = {w: hashlib.sha256(open(w, "rb").read()).hexdigest() for w in wheels}
items = []  # (name, bytes): whole wheels, and the parts of those larger than a piece
for wheel in wheels:
    data = open(wheel, "rb").read()
    name = os.path.basename(wheel)
    if len(data) <= limit:
        items.append((name, data))
    else:
        items += [(f"{name}.part{k:02d}", data[i : i + limit]) for k, i in enumerate(range(0, len(data), limit))]
pieces: list[list] = []  # first fit, largest first
for name, data in sorted(items, key=lambda item: -len(item[1])):
    for piece in pieces:
        if sum(len(d) for _, d in piece) + len(data) <= limit:
            piece.append((name, data))
            break
    else:
        pieces.append([(name, data)])
for k, piece in enumerate(pieces):
    folder = f"{sys.argv[2]}/p{k}"
    os.makedirs(folder)
    for name, data in piece:
        open(f"{folder}/{name}", "wb").write(data)
    with open(f"{folder}/SHA256SUMS", "w") as out:
        out.writelines(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in piece)
    with open(f"{folder}/WHEELS", "w") as out:
        out.writelines(f"{sums[w]}  {os.path.basename(w)}\n" for w in wheels)
    total = sum(len(d) for _, d in piece) / 2**20
    print(f"{folder}: {len(piece)} files, {total:.1f} MiB: {' '.join(n.split('-')[0] + ('' if n.endswith('.whl') else '.' + n[-6:]) for n, _ in piece)}")
PY
}

stage() {
  (cd "$1" && sha256sum -c --quiet SHA256SUMS)
  mkdir -p "$VERL_STAGE" && cp "$1"/* "$VERL_STAGE"/
  echo "staged $(($(wc -l < "$1"/SHA256SUMS))) files from $1; $VERL_STAGE holds $(($(ls "$VERL_STAGE" | wc -l) - 2)) (the $(($(wc -l < "$1"/WHEELS))) wheels, the large ones in parts)"
}

join_parts() {  # each split wheel from its parts; every wheel checked against WHEELS
  for first in "$VERL_STAGE"/*.whl.part00; do
    [ -e "$first" ] || continue
    cat "${first%.part00}".part[0-9][0-9] > "${first%.part00}"
  done
  (cd "$VERL_STAGE" && sha256sum -c --quiet WHEELS) || {
    echo "verl_stage: a staged wheel is missing or corrupt (above); stage every $STAGE_PIECES/pN first" >&2; exit 1; }
}

install() {
  join_parts
  py=$(python_for_device)
  export PYTHONPATH=$PWD:/tmp/rlrun_site:/tmp/trl_site  # as the benchmark runs: what those hold counts as present
  missing=$("$py" - "$VERL_STAGE"/*.whl <<'PY'
import importlib.metadata as md, sys
for wheel in sys.argv[1:]:
    try:
        md.version(wheel.rsplit("/", 1)[-1].split("-")[0])
    except md.PackageNotFoundError:
        print(wheel)
PY
)
  echo "python: $py; installing into $VERL_SITE: $(for w in $missing; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"
  [ -z "$missing" ] || "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$VERL_SITE" $missing
  rm -rf "$VERL_SITE"/{tests,scripts,recipe,tutorial}
  if [ "${CHECK:-1}" = 0 ]; then echo "check skipped (CHECK=0)"; else check "$py"; fi
}

check() {  # versions, the imports the benchmark needs (SGLang's rollout server included), and its config
  PYTHONPATH=$PYTHONPATH:$VERL_SITE "$1" - <<'PY'
import importlib.metadata as md
for n in ["verl", "ray", "transferqueue", "tensordict", "hydra-core", "omegaconf", "torchdata", "peft", "datasets",
          "aiohttp", "cachetools", "codetiming", "sglang", "transformers", "torch", "pandas", "pyarrow", "psutil"]:
    try:
        print(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        print(f"{n} MISSING: stage the piece that holds it (bash scripts/gpu/verl_stage.sh split lists them)")
import transfer_queue  # noqa: F401
import verl.trainer.main_ppo  # noqa: F401
import verl.workers.rollout.sglang_rollout.async_sglang_server  # noqa: F401  imports sglang's server
print("verl import ok")
PY
  for offload in on off; do
    PYTHONPATH=$PYTHONPATH:$VERL_SITE "$1" benchmarks/verl_grpo.py --check-config --offload $offload --work /tmp/verl_check
  done
}

case "${1:-}" in
  download) download ;;
  split) split ;;
  stage) stage "$2" ;;
  install) install ;;
  join) join_parts ;;
  *) echo "usage: $0 download | split | stage .verl/pN | install | join" >&2; exit 2 ;;
esac
