"""SDPACoreAttention against an eager softmax reference, and the packed layout read from position_ids."""

from __future__ import annotations

import math

import pytest
import torch

HEADS, KV_HEADS, DIM = 4, 2, 8


@pytest.fixture(scope="module")
def attention():
    from core_attention import make_core_attention
    from rlrun.megatron.attention import SDPACoreAttention

    return make_core_attention(SDPACoreAttention, HEADS, KV_HEADS, DIM)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v for ``[T, heads, dim]`` inputs, key/value heads repeated."""
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(DIM)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


def qkv(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, HEADS, DIM, generator=gen),
        torch.randn(tokens, KV_HEADS, DIM, generator=gen),
        torch.randn(tokens, KV_HEADS, DIM, generator=gen),
    )


def test_unpacked_rows_are_causal(attention):
    rows = [qkv(7, seed) for seed in (0, 1)]
    q, k, v = (torch.stack([r[i] for r in rows], dim=1) for i in range(3))  # [S, B, heads, dim]
    out = attention(q, k, v, None)
    assert out.shape == (7, 2, HEADS * DIM)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    for b, (qb, kb, vb) in enumerate(rows):
        torch.testing.assert_close(out[:, b], eager(qb, kb, vb, causal).reshape(7, -1))


def test_packed_rows_attend_within_each_sample(attention):
    from rlrun.megatron.attention import packed_seq_params

    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    params = packed_seq_params(positions, torch.device("cpu"))
    assert params.cu_seqlens_q.tolist() == [0, 4, 7, 12] and params.max_seqlen_q == 5
    q, k, v = qkv(12, 2)
    out = attention(q, k, v, None, packed_seq_params=params)
    sample = torch.tensor([0] * 4 + [1] * 3 + [2] * 5)
    block_causal = (sample[:, None] == sample[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(out, eager(q, k, v, block_causal).reshape(12, -1))


def test_packed_seq_params_reads_position_ids():
    from rlrun.megatron.attention import packed_seq_params

    cpu = torch.device("cpu")
    assert packed_seq_params(torch.arange(6).expand(3, 6), cpu) is None  # plain rows: nothing packed
    two_rows = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    assert packed_seq_params(two_rows, cpu).cu_seqlens_kv.tolist() == [0, 3, 6, 12]
    with pytest.raises(ValueError, match="position_ids must count"):
        packed_seq_params(torch.tensor([[0, 1, 3, 0, 1, 2]]), cpu)
    with pytest.raises(ValueError, match="position_ids must count"):
        packed_seq_params(torch.tensor([[1, 2, 3, 0, 1, 2]]), cpu)


def test_layer_spec_swaps_only_the_core_attention_and_the_norms(tiny_model_dirs):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rlrun.kernels.head_norm import HeadNorm
    from rlrun.kernels.hidden_norm import HiddenNorm
    from rlrun.megatron.attention import SDPACoreAttention, layer_spec, transformer_engine_attention
    from rlrun.megatron.hf_config import ModelArch

    arch = ModelArch.from_hf_dir(str(tiny_model_dirs["qwen3"]))  # QK-norm
    spec, local = layer_spec(arch), get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    got, want = spec.submodules.self_attention.submodules, local.submodules.self_attention.submodules
    assert got.core_attention is (transformer_engine_attention() or SDPACoreAttention)
    assert got.linear_qkv is want.linear_qkv and got.linear_proj is want.linear_proj
    assert got.q_layernorm is got.k_layernorm is HeadNorm  # the engine's q_norm / k_norm run the same (head_norm.py)
    assert spec.submodules.input_layernorm is spec.submodules.pre_mlp_layernorm is HiddenNorm  # and hidden_norm.py
    assert local.submodules.input_layernorm is not HiddenNorm
    llama = layer_spec(ModelArch.from_hf_dir(str(tiny_model_dirs["llama"]))).submodules.self_attention.submodules
    assert llama.q_layernorm is not HeadNorm and llama.k_layernorm is not HeadNorm  # no QK-norm there


def test_packed_attention_choice_is_checked():
    from rlrun.kernels.triton_support import triton_available
    from rlrun.megatron.attention import SDPACoreAttention, core_attention, transformer_engine_attention

    with pytest.raises(ValueError, match="model.packed_attention"):
        core_attention("flash")
    if transformer_engine_attention() is not None:
        return
    assert core_attention("per_sample") is SDPACoreAttention
    if not torch.cuda.is_available():
        assert core_attention("auto", "bfloat16") is SDPACoreAttention
        assert core_attention("auto", "float32") is SDPACoreAttention
        for varlen in ("flash_varlen", "efficient_varlen", "cudnn_per_sample"):
            with pytest.raises(ValueError, match="needs CUDA"):
                core_attention(varlen)
    else:  # the engine's kernels (rlrun.kernels.attention.auto_packed_attention): chunked in bf16 where Triton is
        chunked = "ChunkedVarlenCoreAttention" if triton_available() else "EfficientVarlenCoreAttention"
        assert core_attention("auto", "bfloat16").__name__ == chunked
        assert core_attention("auto", "float32").__name__ == "EfficientVarlenCoreAttention"
        for kernel in ("flash_varlen", "cudnn_per_sample"):
            with pytest.raises(ValueError, match="needs model.dtype bfloat16"):
                core_attention(kernel, "float32")


@pytest.mark.parametrize("kind", ["flash", "efficient"])
def test_varlen_call_fits_the_kernel_schema_and_its_autograd(kind):
    """The varlen kernel is CUDA-only; on meta tensors its schema, shape rules and backward formula still run,
    so a wrong argument (order, dtype of the bounds, GQA head counts) fails here, not first on a GPU."""
    from core_attention import make_core_attention
    from rlrun.megatron.attention import EfficientVarlenCoreAttention, FlashVarlenCoreAttention, PackedRows

    heads, kv_heads, dim = 16, 8, 128
    cls = FlashVarlenCoreAttention if kind == "flash" else EfficientVarlenCoreAttention
    attention = make_core_attention(cls, heads, kv_heads, dim)
    bounds = torch.tensor([0, 640, 677, 1280], dtype=torch.int32)
    params = PackedRows(
        qkv_format="thd",
        cu_seqlens_q=bounds,
        cu_seqlens_kv=bounds,
        max_seqlen_q=640,
        max_seqlen_kv=640,
        cu_seqlens_device=bounds.to("meta"),
    )
    q, k, v = (
        torch.empty(1280, h, dim, device="meta", dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    )
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (1280, heads * dim) and out.dtype == torch.bfloat16
    assert out.grad_fn is not None
    if kind == "flash":  # torch 2.13's meta kernel of the efficient backward takes ``scale`` twice (a torch bug)
        out.sum().backward()
        assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    with pytest.raises(ValueError, match="cu_seqlens_device"):
        attention(
            q,
            k,
            v,
            None,
            packed_seq_params=PackedRows(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=640),
        )


@pytest.mark.parametrize(
    ("dtype", "widths", "takes"),
    [
        (torch.bfloat16, (128, 128), True),
        (torch.bfloat16, (192, 128), True),  # DeepSeek-V3's MLA
        (torch.bfloat16, (20, 10), False),  # the tiny DeepSeek-V3 of tests/tiny_models.py
        (torch.float16, (16, 12), False),
        (torch.float32, (20, 12), True),
        (torch.float32, (20, 10), False),
    ],
)
def test_the_shared_kernel_takes_head_widths_of_whole_16_byte_multiples(dtype, widths, takes):
    from rlrun.kernels import attention as attention_kernel

    assert attention_kernel.kernel_has_head_dims(dtype, *widths) is takes
    query = torch.zeros(1, 1, 1, widths[0], dtype=dtype)
    assert not attention_kernel.uses_shared_kernel(query, torch.zeros(1, 1, 1, widths[1], dtype=dtype))  # CPU: SDPA


def test_efficient_varlen_refuses_heads_the_kernel_has_none_for():
    from rlrun.kernels import attention as attention_kernel

    q = torch.zeros(8, 2, 20, dtype=torch.bfloat16)
    v = torch.zeros(8, 2, 10, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match="heads 20 .query. and 10 .value. wide.*use model.packed_attention: per_sample"
    ):
        attention_kernel.causal_varlen(q, q, v, torch.tensor([0, 8], dtype=torch.int32), 8)


def test_flash_logsumexp_puts_each_token_s_row_where_flashattention_reads_it():
    """The memory-efficient kernel keeps a packed row's log-sum-exp per sample (``[samples, heads, max_len padded]``,
    rows from 0 in each sample); FlashAttention-2's varlen backward reads it per token (``[heads, tokens]``)."""
    from rlrun.kernels.attention import _flash_logsumexp

    lengths, heads, padded = [3, 1, 5], 2, 32
    samples = torch.arange(len(lengths)).view(-1, 1, 1)
    lse = (1000 * samples + 100 * torch.arange(heads).view(1, -1, 1) + torch.arange(padded).view(1, 1, -1)).float()
    bounds = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    got = _flash_logsumexp(lse, bounds, 9)
    expected = [[1000 * i + 100 * h + p for i, n in enumerate(lengths) for p in range(n)] for h in range(heads)]
    assert got.shape == (heads, 9) and got.is_contiguous()
    assert got.tolist() == expected
