"""On a GPU, the engine's fused q/k/v and gate/up GEMMs give the unfused GEMMs' results to one rounding at the
shapes a decode step and a prefill run, and an engine with them generates the same tokens and log-probs as one
without them on the tiny families. The trainer-vs-engine gate (``test_onpolicy_gpu.py``, 1e-6 on the real
SmolLM2) runs with them too.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_fused_projections_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("hidden", "parts"),
    [
        (1024, (2048, 1024, 1024)),  # Qwen3-0.6B q/k/v
        (1024, (3072, 3072)),  # Qwen3-0.6B gate/up
        (2048, (2048, 1024, 1024)),  # Qwen3-1.7B q/k/v
        (2048, (6144, 6144)),  # Qwen3-1.7B gate/up
        (576, (576, 192, 192)),  # SmolLM2-135M q/k/v
        (576, (1536, 1536)),  # SmolLM2-135M gate/up
    ],
)
@pytest.mark.parametrize("rows", [1, 16, 64, 128, 300, 4096])
def test_fused_gemm_is_the_separate_gemms_to_one_rounding(dtype, hidden, parts, rows):
    """Not bit for bit: cuBLAS picks its kernel (tile, split-K) from the output width. This test's bitwise version had
    23 failures among these 72 cases and the 4 engine cases below on the H200 (2026-12-02; those shown were fp32).
    A different summation order of the same products differs by at most one rounding of the output."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    weights = [(torch.randn(n, hidden, device="cuda", generator=g) / hidden**0.5).to(dtype) for n in parts]
    separate = torch.cat([torch.nn.functional.linear(x, w) for w in weights], dim=-1)
    fused = torch.nn.functional.linear(x, torch.cat(weights))
    one_rounding = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(fused, separate, **one_rounding)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "mistral"])
def test_engine_generates_the_same_with_and_without_fused_projections(tmp_path, monkeypatch, kind):
    from rlrun.engine.embedded import engine as embedded
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(kind, tmp_path / "m", seed=3)
    prompts = [list(range(3, 60)), [7, 8, 9]]
    params = {"max_new_tokens": 200, "temperature": 1.0, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    engine = embedded.EmbeddedEngine(model, seed=0, dtype="bfloat16", device="cuda")
    assert engine._slices  # fused
    fused = engine.generate(prompts, params)
    engine.free_cache()
    monkeypatch.setattr(embedded, "fuse_projections", lambda model: {})
    plain = embedded.EmbeddedEngine(model, seed=0, dtype="bfloat16", device="cuda")
    separate = plain.generate(prompts, params)
    for a, b in zip(fused, separate, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"]
