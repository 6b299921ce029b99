"""On a GPU, the trainer's RoPE runs the Triton rotation (rlrun/kernels/rope.py, through rlrun/megatron/rope_apply.py)
and its queries, keys and their gradients are Megatron's eager ones bit for bit.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_rope_apply_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from rope_cases import rotations

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")


@pytest.mark.parametrize(
    ("head_dim", "dtype", "exact_mapping"),
    [(128, "bfloat16", False), (64, "bfloat16", True), (128, "float32", False), (128, "float16", False)],
)
def test_triton_rotation_is_megatrons_bit_for_bit(head_dim, dtype, exact_mapping):
    out = run_distributed(rotations, 1, head_dim, head_dim, dtype, exact_mapping, "cuda")
    for case, checks in out["cases"].items():
        assert all(checks.values()), (case, checks)
    assert out["kernel_calls"] > 0
