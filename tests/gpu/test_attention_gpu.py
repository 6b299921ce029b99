"""FlashVarlenCoreAttention (one varlen kernel per packed row) against the per-sample SDPA path, forward
and backward, in bf16 on a GPU, with Qwen3-0.6B's head layout (16 query heads, 8 key/value heads, 128)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

HEADS, KV_HEADS, DIM = 16, 8, 128


def make(cls):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=DIM,
        attention_dropout=0.0,
    )
    return cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def test_varlen_matches_per_sample_sdpa_forward_and_backward():
    from rlrun.megatron.attention import FlashVarlenCoreAttention, SDPACoreAttention, packed_seq_params

    lengths = [640, 640, 37, 300, 1, 512]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    params = packed_seq_params(positions, torch.device("cuda"))
    assert params.cu_seqlens_device.is_cuda and params.cu_seqlens_q.device.type == "cpu"
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(lengths)
    leaves = [
        torch.randn(tokens, h, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    ]
    grad_out = torch.randn(tokens, HEADS * DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {}
    for cls in (SDPACoreAttention, FlashVarlenCoreAttention):
        inputs = [t.clone().requires_grad_(True) for t in leaves]
        out = make(cls)(*inputs, None, packed_seq_params=params)
        out.backward(grad_out)
        results[cls.__name__] = (out.float(), *(t.grad.float() for t in inputs))
    for reference, varlen, name in zip(
        results["SDPACoreAttention"], results["FlashVarlenCoreAttention"], ("output", "dq", "dk", "dv"), strict=False
    ):
        torch.testing.assert_close(varlen, reference, atol=2e-2, rtol=2e-2, msg=f"{name} differs")
