"""On a GPU, the engine's Triton kernels are the eager ops they replace bit for bit (the fused RoPE is
transformers' ``apply_rotary_pos_emb``, the K/V column write is two ``scatter_``), and an engine with them
generates the same tokens and log-probs as one without them; the greedy pick is torch's first argmax, its log-prob
within fp32 rounding of ``log_softmax``.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_triton_kernels_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("batch", "q_heads", "k_heads", "seq", "dim"),
    [(64, 16, 8, 1, 128), (3, 32, 8, 137, 128), (5, 4, 4, 9, 64), (2, 6, 2, 33, 80)],
)
def test_kernel_is_transformers_rope_bit_for_bit(dtype, batch, q_heads, k_heads, seq, dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rlrun.engine.embedded.fused_rope import kernel_covers, rope_qk

    g = torch.Generator(device="cuda").manual_seed(0)
    # As a decoder layer hands them over: [B, S, H, D] projections viewed as [B, H, S, D].
    q = (3 * torch.randn(batch, seq, q_heads, dim, device="cuda", generator=g)).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(batch, seq, k_heads, dim, device="cuda", generator=g)).to(dtype).transpose(1, 2)
    positions = torch.randint(0, 40000, (batch, seq), device="cuda", generator=g).float()
    inv_freq = 1e6 ** -(torch.arange(0, dim, 2, device="cuda").float() / dim)
    angles = positions[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert kernel_covers(q, k, cos, sin, 1)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope_qk(q, k, cos, sin)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride()


def test_calls_the_kernel_would_get_wrong_go_to_transformers():
    """Each layout ``kernel_covers`` refuses, one at a time from one it takes; a call that needs a gradient
    gets transformers' function, and with it the gradient (the kernel has no backward)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rlrun.engine.embedded.fused_rope import _fused, kernel_covers

    q, k = torch.randn(2, 5, 4, 8, device="cuda").transpose(1, 2), torch.randn(2, 2, 5, 8, device="cuda")
    cos, sin = torch.randn(2, 5, 8, device="cuda"), torch.randn(2, 5, 8, device="cuda")
    assert kernel_covers(q, k, cos, sin, 1)
    assert not kernel_covers(q, k, cos, sin, 2)
    assert not kernel_covers(q, k, cos[:1], sin[:1], 1)  # cos broadcast over the batch
    assert not kernel_covers(q, k, cos.bfloat16(), sin.bfloat16(), 1)
    assert not kernel_covers(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7], 1)  # odd D
    assert not kernel_covers(q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2], 1)  # strided D
    assert not kernel_covers(q, k[:, :, :4], cos, sin, 1)
    leaf = q.detach().requires_grad_()
    assert not kernel_covers(leaf, k, cos, sin, 1)
    with torch.no_grad():
        assert kernel_covers(leaf, k, cos, sin, 1)
    fused_q, _ = _fused(apply_rotary_pos_emb)(leaf, k, cos, sin)
    (grad,) = torch.autograd.grad(fused_q.sum(), leaf)
    (expected,) = torch.autograd.grad(apply_rotary_pos_emb(leaf, k, cos, sin)[0].sum(), leaf)
    assert torch.equal(grad, expected)


def scattered(cache: torch.Tensor, new: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The eager write the kernel replaces (StaticKVCache.update's ``scatter_``), on a copy of ``cache``."""
    index = columns.view(-1, 1, 1, 1).expand(-1, new.shape[1], 1, new.shape[-1])
    return cache.clone().scatter_(2, index, new)


@pytest.mark.parametrize(
    ("rows", "k_heads", "v_heads", "k_dim", "v_dim"), [(64, 8, 8, 128, 128), (5, 2, 2, 64, 64), (3, 1, 1, 512, 64)]
)
def test_kv_column_write_is_the_two_scatters(rows, k_heads, v_heads, k_dim, v_dim):
    from rlrun.engine.embedded.triton_kernels import write_kv_columns

    g = torch.Generator(device="cuda").manual_seed(1)
    length = 300
    key_cache = torch.randn(rows, k_heads, length, k_dim, device="cuda", generator=g).bfloat16()
    value_cache = torch.randn(rows, v_heads, length, v_dim, device="cuda", generator=g).bfloat16()
    # As the attention hands them over: [rows, 1, heads, dim] projections viewed as [rows, heads, 1, dim].
    key = torch.randn(rows, 1, k_heads, k_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    value = torch.randn(rows, 1, v_heads, v_dim, device="cuda", generator=g).bfloat16().transpose(1, 2)
    columns = torch.randint(0, length, (rows,), device="cuda", generator=g)
    expected_k, expected_v = scattered(key_cache, key, columns), scattered(value_cache, value, columns)
    write_kv_columns(key_cache, value_cache, key, value, columns)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.parametrize(
    ("kind", "overrides", "fused"),  # fused: the modeling module's apply_rotary_pos_emb is swapped
    [
        ("qwen3", {}, True),
        ("llama", {}, True),
        ("mistral", {}, True),
        ("qwen3_moe", {}, True),
        ("glm4_moe", {}, False),  # partial rotary: its own RoPE; the K/V write still runs
        ("deepseek_v3", {}, True),  # swapped, but its interleaved RoPE is another function; K/V of two widths
        ("deepseek_v3", {"rope_interleave": False}, True),  # Llama's RoPE on split, single-head MLA views
    ],
)
def test_engine_generates_the_same_with_and_without_its_triton_kernels(tmp_path, monkeypatch, kind, overrides, fused):
    import importlib

    from transformers import AutoConfig

    from rlrun.engine.embedded import fused_rope, static_cache
    from rlrun.engine.embedded.engine import EmbeddedEngine
    from rlrun.engine.embedded.routing_record import RouterContractError
    from tests.tiny_models import make_tiny_model

    model = make_tiny_model(kind, tmp_path / "m", seed=3, config_overrides=overrides)
    family = AutoConfig.from_pretrained(model).model_type
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    prompts = [list(range(3, 60)), [7, 8, 9]]
    params = {"max_new_tokens": 200, "temperature": 1.0, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    try:  # GLM-4 MoE's and DeepSeek-V3's routers before transformers 5.17 (SGLang's 5.12.1) are refused
        engine = EmbeddedEngine(model, seed=0, dtype="bfloat16", device="cuda")
        with_kernel = engine.generate(prompts, params)
    except RouterContractError as refused:
        pytest.skip(str(refused))
    original = getattr(modeling.apply_rotary_pos_emb, "_rlrun_original", None)
    assert (original is not None) is fused
    engine.free_cache()
    if fused:
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", original)
    monkeypatch.setattr(fused_rope, "triton_available", lambda: False)
    monkeypatch.setattr(static_cache, "triton_available", lambda: False)
    eager = EmbeddedEngine(model, seed=0, dtype="bfloat16", device="cuda")
    assert getattr(modeling.apply_rotary_pos_emb, "_rlrun_original", None) is None
    without = eager.generate(prompts, params)
    for a, b in zip(with_kernel, without, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_kernels_run_on_their_tensors_device_not_the_current_one():
    """Tensors on cuda:1 while the current device is cuda:0 (the embedded backend's decode thread of rank 1's
    engine): Triton would launch on cuda:0 and its stream; the results must still be the eager ones."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from rlrun.engine.embedded.fused_rope import rope_qk
    from rlrun.engine.embedded.triton_kernels import write_kv_columns

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    q, k = torch.randn(4, 9, 8, 64, device=dev).bfloat16().transpose(1, 2), torch.randn(4, 2, 9, 64, device=dev)
    k = k.bfloat16()
    cos, sin = torch.randn(4, 9, 64, device=dev).bfloat16(), torch.randn(4, 9, 64, device=dev).bfloat16()
    got, expected = rope_qk(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    cache_k, cache_v = torch.zeros(4, 2, 16, 64, device=dev), torch.zeros(4, 2, 16, 32, device=dev)
    key, value = torch.randn(4, 2, 1, 64, device=dev), torch.randn(4, 2, 1, 32, device=dev)
    columns = torch.tensor([0, 5, 15, 3], device=dev)
    want_k, want_v = scattered(cache_k, key, columns), scattered(cache_v, value, columns)
    write_kv_columns(cache_k, cache_v, key, value, columns)
    torch.cuda.synchronize(dev)
    assert torch.equal(cache_k, want_k) and torch.equal(cache_v, want_v)
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize(("rows", "vocab"), [(64, 151936), (128, 151936), (7, 49152)])
def test_the_greedy_pick_is_the_first_argmax_and_its_log_softmax(rows, vocab):
    from rlrun.engine.embedded.triton_kernels import greedy_tokens

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(rows, vocab, device="cuda", generator=g)).bfloat16()
    logits[0, 17] = logits[0, 17 + 4096] = logits.max() + 1  # a tie within one lane of the kernel: the first wins
    temperature = torch.rand(rows, device="cuda", generator=g) + 0.5
    tokens, logprobs = greedy_tokens(logits, temperature)
    assert torch.equal(tokens, logits.argmax(-1)) and tokens[0] == 17
    want = torch.log_softmax(logits.double() / temperature.double()[:, None], -1).gather(-1, tokens[:, None])
    torch.testing.assert_close(logprobs.double(), want.squeeze(-1), rtol=0, atol=2e-6)
