"""Engine groups in one process: which rank leads which group, how outputs go back to their ranks,
and the per-TP-rank payload list."""

from __future__ import annotations

import re

import pytest
import torch

from rlrun.config.schema import EngineConfig
from rlrun.engine.group import GroupLayout, _split
from rlrun.engine.payload import deserialize_flattened_bucket, serialize_for_tp_ranks


def test_groups_are_consecutive_local_ranks_led_by_their_first():
    # 2 nodes x 4 ranks, engine.tp=2: global rank = node * 4 + local rank (torchrun's numbering).
    layouts = [
        GroupLayout.of(2, rank=node * 4 + local, local_rank=local, world_size=8, local_world_size=4)
        for node in range(2)
        for local in range(4)
    ]
    assert [lay.leader for lay in layouts] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert [lay.local_leader for lay in layouts] == [0, 0, 2, 2, 0, 0, 2, 2]  # base_gpu_id on each node
    assert [lay.is_leader for lay in layouts] == [True, False] * 4
    assert layouts[5].all_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    single = GroupLayout.of(1, rank=3, local_rank=3, world_size=4, local_world_size=4)
    assert single.is_leader and single.all_groups() == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    "tp,world_size,local_world_size,words",
    [
        (2, 3, 3, "must divide the ranks per node (3)"),
        (4, 8, 2, "must divide the ranks per node (2)"),
        (2, 5, 2, "must divide the world size (5)"),  # nodes with different numbers of ranks
    ],
)
def test_layouts_that_cannot_form_whole_groups_are_refused(tp, world_size, local_world_size, words):
    with pytest.raises(ValueError, match=re.escape(f"engine.tp ({tp}) {words}")):
        GroupLayout.of(tp, rank=0, local_rank=0, world_size=world_size, local_world_size=local_world_size)


def test_engine_tp_above_one_is_a_valid_config():
    assert EngineConfig(tp=2).tp == 2
    with pytest.raises(ValueError):
        EngineConfig(tp=0)


def test_split_returns_each_rank_the_outputs_of_its_own_items():
    counts = [2, 0, 1]  # items per rank; 3 outputs per item, item-major
    outputs = [f"item{i}-out{j}" for i in range(3) for j in range(3)]
    assert _split(outputs, counts, 3) == [outputs[:6], [], outputs[6:]]
    with pytest.raises(RuntimeError, match="8 outputs for 3 items x 3"):
        _split(outputs[:8], counts, 3)


def test_one_payload_per_tp_rank_each_carrying_the_full_tensors():
    g = torch.Generator().manual_seed(0)
    tensors = [("w", torch.randn(3, 5, generator=g)), ("b", torch.randn(5, generator=g).to(torch.bfloat16))]
    payloads = serialize_for_tp_ranks(tensors, 2)
    assert len(payloads) == 2
    for payload in payloads:  # each entry is unpickled on its own (a payload can be claimed once)
        restored = deserialize_flattened_bucket(payload)
        assert [n for n, _ in restored] == ["w", "b"]
        for (_, want), (_, got) in zip(tensors, restored, strict=False):
            assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(ValueError, match="tp_size \\(0\\) must be >= 1"):
        serialize_for_tp_ranks(tensors, 0)
