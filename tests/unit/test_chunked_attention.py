"""The chunked kernels' wiring (``model.packed_attention: chunked_varlen`` -> the embedded engine's kernel family)
and, where Triton is installed, their logic under Triton's interpreter (fp32 against a float64 reference; bitwise
equality is a GPU question: tests/gpu/test_chunked_attention_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from interpreted import needs_triton, run_interpreted
from minimal_config import run_config
from rlrun.engine.embedded.engine import _attention_implementation
from rlrun.engine.registry import BackendSpec
from rlrun.kernels import attention as attention_kernel
from rlrun.tools.bench.engines import bench_spec


def test_a_chunked_varlen_trainer_gives_its_embedded_engine_the_chunked_kernels():
    # on CPU: auto is per_sample there, so its engine the memory-efficient family
    for attention, kernel in (("chunked_varlen", "chunked"), ("auto", "efficient"), ("flash_varlen", "efficient")):
        cfg = run_config({"model": {"packed_attention": attention}})
        spec = BackendSpec.from_json(BackendSpec.from_config(cfg, seed=0).to_json())  # as the worker reads it
        assert spec.attention_kernel == kernel
    assert bench_spec("embedded_chunked", Path("m"), "bfloat16", 0).attention_kernel == "chunked"
    assert bench_spec("embedded_chunked", Path("m"), "bfloat16", 0).backend == "embedded"
    assert bench_spec("embedded_efficient", Path("m"), "bfloat16", 0).attention_kernel == "efficient"
    assert bench_spec("embedded", Path("m"), "bfloat16", 0).attention_kernel == "efficient"  # CPU: auto's


def _on_cuda_with_triton(monkeypatch, triton: bool = True) -> None:
    """What ``auto`` reads of the machine, as on a CUDA machine (nothing runs on it here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention_kernel, "triton_available", lambda: triton)


@pytest.mark.parametrize(
    ("model", "cp", "triton", "trainer", "engine"),
    [
        ({"dtype": "bfloat16"}, 1, True, "chunked_varlen", "chunked"),  # the default on a GPU
        ({"dtype": "bfloat16"}, 2, True, "chunked_varlen", "efficient"),  # context parallelism's own kernel
        ({"dtype": "float32"}, 1, True, "efficient_varlen", "efficient"),  # the chunked kernels are bf16's
        ({"dtype": "bfloat16"}, 1, False, "efficient_varlen", "efficient"),
        ({"dtype": "bfloat16", "packed_attention": "efficient_varlen"}, 1, True, "efficient_varlen", "efficient"),
    ],
)
def test_auto_on_a_gpu_puts_trainer_and_engine_on_one_kernel_family(monkeypatch, model, cp, triton, trainer, engine):
    _on_cuda_with_triton(monkeypatch, triton)
    cfg = run_config({"model": model, "parallel": {"cp": cp}})
    assert BackendSpec.from_config(cfg, seed=0).attention_kernel == engine
    if cfg.model.packed_attention == "auto":
        assert attention_kernel.auto_packed_attention(cfg.model.dtype) == trainer
        if cp == 1:  # the bench's plain "embedded" is the engine of a run with auto
            assert bench_spec("embedded", Path("m"), cfg.model.dtype, 0).attention_kernel == engine


def test_auto_off_cuda_attends_per_sample():
    assert not torch.cuda.is_available()
    assert attention_kernel.auto_packed_attention("bfloat16") == "per_sample"


def test_the_engine_refuses_a_kernel_family_it_cannot_run():
    with pytest.raises(ValueError, match="attention_kernel \\('chunked'\\).*needs CUDA and Triton"):
        _attention_implementation("chunked", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_kernel \\('flash'\\) must be one of"):
        _attention_implementation("flash", torch.device("cpu"))


def test_the_chunked_kernels_never_run_off_cuda():
    q = torch.zeros(2, 4, 128, dtype=torch.bfloat16)
    assert not attention_kernel.chunked_kernel_takes(q, q, 1)  # CPU: both sides run the memory-efficient path / SDPA
    meta = q.to("meta")
    assert not attention_kernel.chunked_kernel_takes(meta, meta, 1)


INTERPRETED = ["chunked_kernels_interpreted.py", "chunked_engine_interpreted.py", "chunked_trainer_interpreted.py"]
"""Scripts run with ``TRITON_INTERPRET=1``: the kernels against float64, the embedded engine on them against its
memory-efficient path (tokens equal, log-probs within 1e-5: fp32 sums in other orders), the trainer's core attention
on them against SDPA's."""


@needs_triton
@pytest.mark.parametrize("script", INTERPRETED)
def test_the_chunked_kernels_under_tritons_interpreter(script):
    run_interpreted(script, timeout=900)
