#!/usr/bin/env bash
# Refresh the dependency locks from requirements/*.in and pyproject.toml's ranges:
#   requirements/cpu.txt        CI and CPU machines (Python 3.11, Linux x86-64, CPU torch 2.13.0)
#   requirements/gpu-py312.txt  the H200 image (Python 3.12, torch 2.11.0; constrained by gpu-image.txt)
# launch/install.sh installs from the lock; commit the .txt files with the change that needed them.
# Needs uv (pip install uv) and the package registry; the CPU torch wheel is found in /opt/wheels when
# that folder exists, else on PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -d /opt/wheels ]]; then torch_source=(--find-links /opt/wheels); else
  torch_source=(--index https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match); fi
common=(--quiet --python-platform x86_64-manylinux_2_28)
uv pip compile requirements/cpu.in "${common[@]}" --python-version 3.11 "${torch_source[@]}" \
  -o requirements/cpu.txt
uv pip compile requirements/gpu.in "${common[@]}" --python-version 3.12 -c requirements/gpu-image.txt \
  -o requirements/gpu-py312.txt
echo "locked: $(grep -c '==' requirements/cpu.txt) CPU packages, $(grep -c '==' requirements/gpu-py312.txt) GPU packages"
