#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels of requirements/gpu-py312.txt that the H200 image lacks
# (requirements/gpu-image.txt is its pip freeze), at the lock's versions, for Python 3.12 / x86-64.
# Carry ".whl" with the device run and start its command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
# A call carries at most 64 MiB; this set is ~9 MiB (so that a call carries it beside a 46 MiB piece of SmolLM2).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"  # in a worktree .git is a file; this is the shared exclude
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mapfile -t missing < <(python3 - <<'PY'
import re
def pins(path):
    out = {}
    for line in open(path):
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out
image, lock = pins("requirements/gpu-image.txt"), pins("requirements/gpu-py312.txt")
dev_only = {"mypy", "ruff", "ast-serialize", "librt"}  # linters and theirs: 27 MiB the GPU never runs
for name, version in sorted(lock.items()):
    if image.get(name) != version and name not in dev_only:
        print(f"{name}=={version}")
PY
)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${missing[@]}" 2>&1 | grep -v '^WARNING' || true
echo "staged for the image: ${missing[*]}"
du -sh .whl
