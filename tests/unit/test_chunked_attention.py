"""The chunked kernels' wiring (``model.packed_attention: chunked_varlen`` -> the embedded engine's kernel family)
and, where Triton is installed, their logic under Triton's interpreter (fp32 against a float64 reference; bitwise
equality is a GPU question: tests/gpu/test_chunked_attention_gpu.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlrun import attention_kernel
from rlrun.bench.engines import bench_spec
from rlrun.config.schema import RunConfig
from rlrun.engine.backends import BackendSpec
from rlrun.engine.backends.embedded import _attention_implementation

REPO = Path(__file__).resolve().parents[2]


def test_a_chunked_varlen_trainer_gives_its_embedded_engine_the_chunked_kernels():
    for attention, kernel in (("chunked_varlen", "chunked"), ("auto", "efficient"), ("flash_varlen", "efficient")):
        cfg = RunConfig.model_validate({"model": {"packed_attention": attention}})
        spec = BackendSpec.from_json(BackendSpec.from_config(cfg, seed=0).to_json())  # as the worker reads it
        assert spec.attention_kernel == kernel
    assert bench_spec("embedded_chunked", Path("m"), "bfloat16", 0).attention_kernel == "chunked"
    assert bench_spec("embedded_chunked", Path("m"), "bfloat16", 0).backend == "embedded"
    assert bench_spec("embedded", Path("m"), "bfloat16", 0).attention_kernel == "efficient"


def test_the_engine_refuses_a_kernel_family_it_cannot_run():
    with pytest.raises(ValueError, match="attention_kernel \\('chunked'\\).*needs CUDA and Triton"):
        _attention_implementation("chunked", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_kernel \\('flash'\\) must be one of"):
        _attention_implementation("flash", torch.device("cpu"))


def test_the_chunked_kernels_take_only_cuda_half_precision_power_of_two_heads():
    q = torch.zeros(2, 4, 128, dtype=torch.bfloat16)
    assert not attention_kernel.chunked_kernel_takes(q, q)  # CPU: both sides run the memory-efficient path / SDPA
    meta = q.to("meta")
    assert not attention_kernel.chunked_kernel_takes(meta, meta)


INTERPRETED = textwrap.dedent(
    """
    import torch
    from rlrun import chunked_attention as ca

    torch.manual_seed(0)
    H, KV, D, L = 4, 2, 16, 160
    lengths = [70, 5, 133]
    cu = torch.tensor([0, 70, 75, 208], dtype=torch.int32)
    q, k, v = (torch.randn(208, h, D) for h in (H, KV, KV))

    def reference(a, b):
        g = H // KV
        kk, vv = k[a:b].double().repeat_interleave(g, 1), v[a:b].double().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b].double(), kk) * D**-0.5
        n = b - a
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv), torch.logsumexp(s, -1)

    for chunk in (32, 64):
        out, lse = ca.causal_varlen(q, k, v, cu, 133, D**-0.5, True, block_m=16, chunk=chunk)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            want, want_lse = reference(a, b)
            assert (out[a:b] - want).abs().max() < 1e-5, chunk
            assert (lse[:, a:b] - want_lse).abs().max() < 1e-5, chunk
        cache_k, cache_v = torch.zeros(3, KV, L, D), torch.zeros(3, KV, L, D)
        counts = torch.tensor([133, 100, 1], dtype=torch.int32)
        for row, c in enumerate(counts.tolist()):  # rows of sample 2 at its positions c - 1
            cache_k[row, :, :c], cache_v[row, :, :c] = k[75 : 75 + c].transpose(0, 1), v[75 : 75 + c].transpose(0, 1)
        last = torch.tensor([75 + c - 1 for c in counts.tolist()])
        got = ca.decode(q[last], cache_k, cache_v, counts, D**-0.5, chunk=chunk)
        assert (got - out[last]).abs().max() < 1e-6, chunk
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
def test_the_kernels_logic_under_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
