"""HF <-> Megatron tensor layouts and TP sharding, on plain tensors (no processes, no Megatron model).

The QKV and SwiGLU layouts are checked against layouts written out head by head here, not against the
reshape tricks of the implementation; SmolLM2's 9 heads / 3 KV groups is checked at TP=3 (no padding)
and at TP=2 and TP=4 (inert zero groups appended).
"""

from __future__ import annotations

import pytest
import torch

from rlrun.megatron.hf_config import ModelArch
from rlrun.megatron.hf_weights import HFCheckpoint, WeightMapping, to_hf, to_megatron, weight_mappings
from rlrun.megatron.tp_layout import Partition

HEAD_DIM, HIDDEN = 2, 5


def _arch(num_heads: int, num_kv_heads: int) -> ModelArch:
    return ModelArch(
        model_type="llama",
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=6,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        vocab_size=10,
        max_position_embeddings=16,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        qkv_bias=False,
        qk_norm=False,
    )


def _labelled_heads(num_heads: int, offset: int) -> torch.Tensor:
    """[num_heads * HEAD_DIM, HIDDEN] whose rows of head h all equal offset + h."""
    return (offset + torch.arange(num_heads)).repeat_interleave(HEAD_DIM)[:, None].float().expand(-1, HIDDEN)


QKV = WeightMapping("qkv", ("q", "k", "v"), "qkv")


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, tp, num_groups",
    [
        (9, 3, 1, 3),
        (9, 3, 3, 3),
        (4, 2, 2, 2),
        (4, 4, 2, 4),
        (9, 3, 2, 4),
        (9, 3, 4, 4),
        (4, 2, 4, 4),
        (6, 2, 3, 3),
        (4, 1, 2, 2),
    ],
)
def test_qkv_shard_holds_whole_query_groups(num_heads, num_kv_heads, tp, num_groups):
    """Rank r holds groups [r * n, (r + 1) * n); groups past the real ones are all-zero rows (label -1)."""
    arch = _arch(num_heads, num_kv_heads)
    q, k, v = _labelled_heads(num_heads, 1), _labelled_heads(num_kv_heads, 101), _labelled_heads(num_kv_heads, 201)
    full = to_megatron(arch, QKV, [q, k, v], tp=tp)
    heads_per_group = num_heads // num_kv_heads
    groups_per_rank = num_groups // tp
    for rank in range(tp):
        expected = []
        for g in range(rank * groups_per_rank, (rank + 1) * groups_per_rank):
            if g < num_kv_heads:
                expected += [1 + g * heads_per_group + i for i in range(heads_per_group)] + [101 + g, 201 + g]
            else:
                expected += [0] * (heads_per_group + 2)
        shard = Partition(dim=0, stride=1).shard(full, rank, tp)
        assert shard[::HEAD_DIM, 0].tolist() == expected
        assert torch.equal(shard, shard[::HEAD_DIM].repeat_interleave(HEAD_DIM, dim=0))  # whole heads only
    assert all(torch.equal(a, b) for a, b in zip(to_hf(arch, QKV, full), (q, k, v), strict=False))


@pytest.mark.parametrize("tp, num_heads_padded", [(1, 9), (2, 12), (3, 9), (4, 12)])
def test_o_proj_gets_zero_columns_for_inert_heads(tp, num_heads_padded):
    """o_proj's input dim is the heads in q order; inert heads come last, so their columns are the last."""
    arch = _arch(9, 3)
    o_proj = torch.randn(HIDDEN, 9 * HEAD_DIM)
    mapping = WeightMapping("proj", ("o",), "o_proj")
    full = to_megatron(arch, mapping, [o_proj], tp=tp)
    assert full.shape == (HIDDEN, num_heads_padded * HEAD_DIM)
    assert torch.equal(full[:, : 9 * HEAD_DIM], o_proj) and not full[:, 9 * HEAD_DIM :].any()
    assert torch.equal(to_hf(arch, mapping, full)[0], o_proj)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_fc1_stride2_shard_is_gate_then_up_of_the_rank(tp):
    gate, up = torch.arange(12.0)[:, None], 100 + torch.arange(12.0)[:, None]
    full = to_megatron(_arch(3, 3), WeightMapping("fc1", ("gate", "up"), "concat"), [gate, up], tp=tp)
    rows = 12 // tp
    for rank in range(tp):
        shard = Partition(dim=0, stride=2).shard(full, rank, tp)
        assert torch.equal(
            shard, torch.cat([gate[rank * rows : (rank + 1) * rows], up[rank * rows : (rank + 1) * rows]])
        )


def test_vocab_rows_are_zero_padded_and_unpadded():
    arch = _arch(3, 3)
    table = torch.randn(10, HIDDEN)
    full = to_megatron(arch, WeightMapping("emb", ("e",), "vocab"), [table], tp=2)
    assert full.shape == (256, HIDDEN) and torch.equal(full[:10], table) and not full[10:].any()
    assert torch.equal(to_hf(arch, WeightMapping("emb", ("e",), "vocab"), full)[0], table)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2, 4])  # the tiny models have 2 KV groups: TP=4 pads them to 4
def test_every_checkpoint_tensor_round_trips_through_shards(kind, tp, tiny_model_dirs):
    arch = ModelArch.from_hf_dir(tiny_model_dirs[kind])
    checkpoint = HFCheckpoint(tiny_model_dirs[kind])
    mappings = weight_mappings(arch)
    assert sorted(n for m in mappings for n in m.hf_names) == sorted(checkpoint.names())
    for mapping in mappings:
        originals = [checkpoint.get(name) for name in mapping.hf_names]
        full = to_megatron(arch, mapping, originals, tp)
        dim = {"copy": 1 if "linear_fc2" in mapping.megatron_name else None, "o_proj": 1}.get(mapping.kind, 0)
        partition = Partition(dim=dim, stride=2 if mapping.kind == "concat" else 1)
        rebuilt = partition.unshard([partition.shard(full, rank, tp) for rank in range(tp)])
        for original, back in zip(originals, to_hf(arch, mapping, rebuilt), strict=False):
            assert torch.equal(original, back), mapping.megatron_name
