"""Which head widths the memory-efficient attention kernel takes, per dtype, against
``rlrun.kernels.attention.kernel_has_head_dims``: one JSON line per case.

Each case runs in its own process: for some widths the kernel does not refuse but launches and fails on the
device ("misaligned address"), which leaves that process's CUDA context unusable.

    python3 scripts/gpu/attention_kernel_widths.py                 # every case, 14 processes at a time
    python3 scripts/gpu/attention_kernel_widths.py bf16 20 10      # one case, in this process
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DTYPES = ("bf16", "fp16", "fp32")
WIDTHS = (
    (128, 128),
    (192, 128),
    (20, 10),
    (12, 12),
    (16, 8),
    (20, 12),
    (8, 8),
    (4, 4),
    (24, 20),
    (10, 10),
    (6, 6),
    (2, 2),
    (20, 16),
    (36, 28),
)  # (query/key, value)


def run_case(dtype_name: str, qk: int, v_dim: int) -> dict:
    """The kernel on causal ``[2, 9, 4, width]`` inputs: ``ok`` with its largest difference from SDPA's math
    in float64, or the first line of its error."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from rlrun.kernels.attention import kernel_has_head_dims

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    case = {"dtype": dtype_name, "qk": qk, "v": v_dim, "kernel_has_head_dims": kernel_has_head_dims(dtype, qk, v_dim)}
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, 9, 4, qk, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    v = torch.randn(2, 9, 4, v_dim, device="cuda", dtype=dtype, generator=gen)
    try:
        out = torch.ops.aten._efficient_attention_forward(
            q, k, v, None, None, None, None, None, 0.0, 1, False, scale=qk**-0.5
        )[0]
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001  the outcome being recorded
        return case | {"kernel": "error", "error": str(exc).splitlines()[0]}
    qd, kd, vd = (t.transpose(1, 2).double() for t in (q, k, v))
    reference = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(1, 2)
    return case | {"kernel": "ok", "max_abs_diff": (out.double() - reference).abs().max().item()}


def in_own_process(case: tuple[str, int, int]) -> dict:
    done = subprocess.run([sys.executable, __file__, *map(str, case)], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"case": case, "kernel": "crashed", "stderr": done.stderr[-500:]}


def main() -> None:
    if len(sys.argv) == 4:
        print(json.dumps(run_case(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
        return
    cases = [(dtype, qk, v) for dtype in DTYPES for qk, v in WIDTHS]
    with ThreadPoolExecutor(14) as pool:
        for result in pool.map(in_own_process, cases):
            print(json.dumps(result))


if __name__ == "__main__":
    main()
