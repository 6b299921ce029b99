"""The embedded engine's prefill of long prompts, in one forward and in column chunks: peak memory, time, agreement.

Why: a refill's prompts are one right-padded prefill forward, whose attention mask and bias grow with prompts x
width^2 and whose activations with prompts x width; ``engine.server_args.chunked_prefill_size`` bounds both
(docs/engine.md, "Chunked prefill"). This measures what it claims: for each setting, one prefill of ``--prompts``
random prompts of ``--width`` tokens through ``EmbeddedEngine`` (a random model of a published shape): the device's
peak memory above the engine's weights (CUDA), the seconds, and whether the next-token logits equal the one-forward
prefill's (bitwise on CUDA; to fp32 rounding on CPU).

    python3 benchmarks/chunked_prefill.py --shape qwen3-0.6b --prompts 32 --width 8192 --sizes 0,16384,65536 \\
        --out benchmarks/results/chunked_prefill_qwen3-0.6b_h200.json
    python3 benchmarks/chunked_prefill.py --shape tiny --device cpu --dtype float32 --prompts 4 --width 64 \\
        --sizes 0,32 --out /tmp/chunked_prefill_cpu.json     # the code path on CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from decode_attention import emit  # benchmarks/, the script's folder

from rlrun.engine.embedded.engine import DTYPES, EmbeddedEngine
from rlrun.tools.bench.shapes import get_shape, write_random_model
from rlrun.tools.bench.timing import hardware, timer


def measure(
    model: Path, prompts: list[list[int]], size: int, dtype: str, device: torch.device
) -> tuple[dict, torch.Tensor]:
    """One prefill through an engine with ``chunked_prefill_size`` = ``size`` (0: unset); its record and logits."""
    engine = EmbeddedEngine(model, seed=0, dtype=dtype, device=device, chunked_prefill_size=size or None)
    with torch.inference_mode():
        engine._prefill(prompts[:1])  # warm-up (kernels, allocator)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with timer(device) as seconds:
            logits = engine._prefill(prompts)[0]
    record = {
        "chunked_prefill_size": size or None,
        "chunks": len(engine.prefill_chunks(len(prompts), max(len(p) for p in prompts))),
        "seconds": round(seconds[0], 4),
    }
    if device.type == "cuda":
        record["peak_gb_above_weights"] = round((torch.cuda.max_memory_allocated(device) - base) / 1e9, 3)
    del engine
    return record, logits.float().cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--sizes", default="0,16384,65536", help="chunked_prefill_size values; 0 = unset.")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU; use --device cpu --shape tiny for the code path")
    sizes = [int(s) for s in args.sizes.split(",")]
    if sizes[0] != 0:
        raise SystemExit(f"--sizes ({args.sizes}) must start with 0 because the one-forward prefill is the reference")
    shape = get_shape(args.shape)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.width // 2, args.width + 1, (args.prompts,), generator=generator).tolist()
    lengths[0] = args.width
    prompts = [torch.randint(3, shape.vocab, (n,), generator=generator).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as tmp:
        model = write_random_model(shape, Path(tmp) / "model", DTYPES[args.dtype], args.device)
        rows, reference = [], None
        for size in sizes:
            record, logits = measure(model, prompts, size, args.dtype, device)
            if reference is None:
                reference = logits
            record["logits_equal"] = bool(torch.equal(logits, reference))
            record["logits_max_abs_diff"] = float((logits - reference).abs().max())
            rows.append(record)
    emit(
        {
            "benchmark": "chunked_prefill",
            "command": "python3 " + " ".join(sys.argv),
            "hardware": hardware(device),
            "torch": torch.__version__,
            "shape": args.shape,
            "dtype": args.dtype,
            "prompts": args.prompts,
            "width": args.width,
            "prompt_tokens": sum(lengths),
            "results": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
