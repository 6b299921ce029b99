"""rlrun/megatron/rope_apply.py rotates queries and keys bitwise as Megatron's own unfused RoPE does, forward and
backward, for packed (``thd``) rows and per-sample (``bshd``) rows, and hands what it does not cover to Megatron.
On CPU the rotation is eager (tests/gpu/test_rope_apply_gpu.py runs the Triton one)."""

from __future__ import annotations

import pytest

from dist_utils import run_distributed
from rope_cases import rotations


@pytest.mark.parametrize(
    ("head_dim", "rot_dim", "dtype", "exact_mapping"),
    [(64, 64, "bfloat16", False), (64, 64, "float32", False), (64, 64, "bfloat16", True), (64, 32, "bfloat16", False)],
)
def test_rotations_are_megatrons_bit_for_bit(head_dim, rot_dim, dtype, exact_mapping):
    out = run_distributed(rotations, 1, head_dim, rot_dim, dtype, exact_mapping)
    for case, checks in out["cases"].items():
        assert all(checks.values()), (case, checks)
    assert out["kernel_calls"] == 0  # no Triton on CPU
