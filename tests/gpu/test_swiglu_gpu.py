"""On a GPU, the SwiGLU kernel (rlrun/kernels/swiglu.py) computes eager PyTorch's ``F.silu(gate) * up`` bit for bit
(exhaustively over every bf16 and fp16 gate value, on random and edge values, row-strided inputs), its backward is
fp32 autograd's to one rounding, the trainer's patched Megatron MLP (rlrun/megatron/swiglu_apply.py) gives Megatron's
forward bits and its gradients to one rounding, and the engine's MLP with the kernel
(rlrun/engine/embedded/fused_swiglu.py) is the MLP without it, bit for bit.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_swiglu_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from swiglu_cases import eager_swiglu, fp32_swiglu_grad, mlp_comparison

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every bit (so ``-0.0`` is not ``0.0``), NaN where eager has NaN (its payload aside: c10's bf16 conversion
    writes 0x7FC0 for every NaN, the GPU's ``cvt`` may write another quiet NaN)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN positions differ"
    same = got.view(BITS[got.dtype]) == want.view(BITS[want.dtype])
    wrong = ~(same | nan)
    if wrong.any():
        at = wrong.nonzero()[:5].tolist()
        pytest.fail(f"{int(wrong.sum())} of {wrong.numel()} values differ, first at {at}: "
                    f"got {got[wrong][:5].tolist()}, eager {want[wrong][:5].tolist()}")  # fmt: skip


def kernel(x: torch.Tensor) -> torch.Tensor:
    from rlrun.kernels.swiglu import swiglu_forward

    return swiglu_forward(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lead", "ffn", "extra"),
    [
        ((4096,), 6144, 0),  # Qwen3-1.7B's ffn, one TP rank
        ((2048, 2), 3072, 0),  # [S, B, 2F]: Qwen3-1.7B at TP 2 / Qwen3-0.6B
        ((64,), 3072, 0),  # a decode step's rows
        ((1,), 3072, 0),
        ((300,), 1537, 0),  # odd F: masked columns
        ((17, 3), 768, 0),
        ((513,), 6144, 128),  # strided rows: a column slice of a wider tensor
        ((33, 4), 100, 7),  # strided rows of a 3-D tensor, F not a multiple of anything
    ],
)
def test_forward_is_eager_bit_for_bit(dtype, lead, ffn, extra):
    g = torch.Generator(device="cuda").manual_seed(0)
    wide = (4 * torch.randn(*lead, 2 * ffn + extra, device="cuda", generator=g)).to(dtype)
    x = wide[..., : 2 * ffn]
    assert extra == 0 or not x.is_contiguous()
    assert_same_bits(kernel(x), eager_swiglu(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_is_eager_for_every_gate_value(dtype):
    """All 65,536 bit patterns of the gate (normals, subnormals, zeros, infinities, NaNs), times ``up`` = 1 (exact:
    the SiLU itself) and times random values."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    up = torch.randn(gate.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)).to(dtype)
    for u in (torch.ones_like(gate), up):
        x = torch.cat([gate, u]).view(1, -1)  # one row, F = 65,536
        assert_same_bits(kernel(x), eager_swiglu(x))
        x = torch.cat([gate.view(256, 256), u.view(256, 256)], dim=1)  # 256 rows, F = 256
        assert_same_bits(kernel(x), eager_swiglu(x))


def test_forward_is_eager_over_fp32_ranges():
    """fp32: 16M random values over the range where SiLU is not x or 0, and the ends of ``expf``'s range."""
    g = torch.Generator(device="cuda").manual_seed(2)
    wide = torch.randn(4096, 4096, device="cuda", generator=g) * 30
    assert_same_bits(kernel(wide), eager_swiglu(wide))
    ends = torch.linspace(-104.0, -80.0, 2**20, device="cuda")  # expf(-x) overflows near -88.72
    tiny = torch.linspace(-1e-37, 1e-37, 2**20, device="cuda")  # subnormal SiLUs
    x = torch.cat([torch.cat([ends, tiny]), torch.rand(2 * 2**20, device="cuda", generator=g)]).view(1, -1)
    assert_same_bits(kernel(x), eager_swiglu(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_eager_on_edge_values(dtype):
    """Every pair (gate, up) of zeros, ones, large and overflowing magnitudes, the largest and smallest normals,
    subnormals, infinities and NaN."""
    info = torch.finfo(dtype)
    values = [0.0, -0.0, 1.0, -1.0, 0.5, 80.0, -80.0, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0, 1e4, -1e4]
    values += [info.max, -info.max, info.tiny, -info.tiny, info.tiny / 4, -info.tiny / 4, info.smallest_normal / 1024]
    values += [float("inf"), float("-inf"), float("nan")]
    v = torch.tensor(values, dtype=torch.float64).to(dtype).cuda()
    n = v.numel()
    x = torch.cat([v.repeat(n), v.repeat_interleave(n)]).view(1, -1)
    assert_same_bits(kernel(x), eager_swiglu(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "ffn", "extra"), [((4096,), 6144, 0), ((300, 2), 1537, 0), ((129,), 768, 64)])
def test_backward_is_fp32_autograd_to_one_rounding(dtype, lead, ffn, extra):
    from rlrun.kernels.swiglu import swiglu_backward

    g = torch.Generator(device="cuda").manual_seed(3)
    x = (4 * torch.randn(*lead, 2 * ffn + extra, device="cuda", generator=g)).to(dtype)[..., : 2 * ffn]
    grad = torch.randn(*lead, ffn + extra, device="cuda", generator=g).to(dtype)[..., :ffn]  # strided too
    got = swiglu_backward(x, grad)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    want = fp32_swiglu_grad(x, grad)  # fp32 autograd, one rounding
    rtol = {torch.bfloat16: 2**-7, torch.float16: 2**-9, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)


def test_autograd_function_of_the_trainer():
    """The Function the patched MLP calls, through torch.autograd: the forward's bits, fp32's gradient."""
    from rlrun.megatron.swiglu_apply import swiglu

    x = (3 * torch.randn(257, 2, 2 * 1000, device="cuda")).bfloat16().requires_grad_()
    grad = torch.randn(257, 2, 1000, device="cuda").bfloat16()
    out = swiglu(x)
    out.backward(grad)
    assert_same_bits(out.detach(), eager_swiglu(x.detach()))
    torch.testing.assert_close(x.grad.float(), fp32_swiglu_grad(x, grad).float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "ffn", "bias"), [("bfloat16", 96, False), ("bfloat16", 37, True), ("float32", 64, False)]
)
def test_patched_megatron_mlp_is_megatrons(dtype, ffn, bias):
    out = run_distributed(mlp_comparison, 1, "cuda", dtype, ffn, bias)
    assert out["kernel_calls"] == 1 and out["scaled_kernel_calls"] == 0
    assert out["forward_bits"] and out["bias"] and out["scaled_equal"] is (None if bias else True)
    # Megatron's eager backward rounds grad * up and the SiLU before its products; the kernel computes in fp32.
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    assert all(e <= tol for e in out["grad_relative_errors"].values()), out["grad_relative_errors"]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_engine_mlp_with_the_kernel_is_the_mlp_without(tmp_path, kind, dtype):
    from transformers import AutoModelForCausalLM

    from rlrun.engine.embedded.fused_projections import fuse_projections
    from rlrun.engine.embedded.fused_swiglu import fuse_swiglu
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(kind, tmp_path / "m", seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval().requires_grad_(False)
    fuse_projections(model)
    mlps = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    hidden = mlps[0].gate_up_proj.weight.shape[1]
    inputs = [torch.randn(*shape, hidden, device="cuda").to(dtype) for shape in ((1, 1), (4, 1), (2, 37), (1, 300))]
    with torch.no_grad():
        want = [[m(x) for x in inputs] for m in mlps]
        ids = torch.randint(0, model.config.vocab_size, (3, 23), device="cuda")
        want_logits = model(ids).logits
        assert fuse_swiglu(model) == len(mlps) == model.config.num_hidden_layers
        got = [[m(x) for x in inputs] for m in mlps]
        got_logits = model(ids).logits
    for g_row, w_row in zip(got, want, strict=True):
        for g, w in zip(g_row, w_row, strict=True):
            assert_same_bits(g, w)
    assert_same_bits(got_logits, want_logits)


def test_engine_generates_the_same_with_and_without_the_kernel(tmp_path, monkeypatch):
    from rlrun.engine.embedded import engine as embedded
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model("qwen3", tmp_path / "m", seed=3)
    prompts = [list(range(3, 60)), [7, 8, 9]]
    params = {"max_new_tokens": 200, "temperature": 1.0, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    engine = embedded.EmbeddedEngine(model, seed=0, dtype="bfloat16", device="cuda")
    assert any("forward" in vars(m) and hasattr(m, "gate_up_proj") for m in engine.model.modules())
    with_kernel = engine.generate(prompts, params)
    engine.free_cache()
    monkeypatch.setattr(embedded, "fuse_swiglu", lambda model: 0)
    without = embedded.EmbeddedEngine(model, seed=0, dtype="bfloat16", device="cuda").generate(prompts, params)
    for a, b in zip(with_kernel, without, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_kernel_runs_on_its_tensors_device_not_the_current_one():
    from rlrun.kernels.swiglu import swiglu_backward

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    x = (3 * torch.randn(300, 2 * 3072, device=dev)).bfloat16()
    grad = torch.randn(300, 3072, device=dev).bfloat16()
    assert_same_bits(kernel(x), eager_swiglu(x))
    torch.testing.assert_close(
        swiglu_backward(x, grad).float(), fp32_swiglu_grad(x, grad).float(), rtol=2**-7, atol=1e-6
    )
    assert torch.cuda.current_device() == 0


def test_silu_is_the_function_eager_calls():
    """The reference is what Megatron's glu and transformers' SiLU call."""
    from transformers.activations import ACT2FN

    x = torch.randn(8, device="cuda")
    assert torch.equal(ACT2FN["silu"](x), F.silu(x))
