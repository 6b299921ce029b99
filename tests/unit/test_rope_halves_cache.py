"""RoPE's frequency-halves check (rlrun/megatron/rope_apply.py) is kept per table without keeping tables alive."""

from __future__ import annotations

import gc
import weakref

import torch

from rlrun.megatron import rope_apply


def test_the_check_is_kept_per_table_without_holding_it():
    tables = [torch.cat([f, f], dim=-1) for f in torch.rand(3, 5, 1, 1, 4)]
    for table in tables:
        assert rope_apply._halves_equal(table) is False  # on the CPU the kernel never runs
        assert rope_apply._halves_cache[id(table)][0]() is table
    dead = weakref.ref(tables.pop())
    del table  # the loop's last reference
    gc.collect()
    assert dead() is None  # the cache did not keep it
    for _ in range(rope_apply.HALVES_CHECKED + 3):
        rope_apply._halves_equal(torch.zeros(2, 1, 1, 4))
    assert len(rope_apply._halves_cache) <= rope_apply.HALVES_CHECKED
