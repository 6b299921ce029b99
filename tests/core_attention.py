"""A core-attention module of rlrun.megatron.attention as Megatron builds one layer's: the tests' one constructor."""

from __future__ import annotations


def make_core_attention(cls: type, heads: int, kv_heads: int, dim: int):
    """``cls`` (SDPACoreAttention or a subclass) for one causal self-attention layer of ``heads`` query heads over
    ``kv_heads`` key/value heads of ``dim``, no dropout."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=dim,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    return cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
