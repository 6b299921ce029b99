"""Decode forwards of a long-tailed call with and without refills: counted, and timed (on a GPU, a measurement).

The same requests as ``rlrun bench rollout --long-tail`` draws them (``LongTail``), through an embedded engine
capped at ``--slots`` running requests: once as one call (ended slots refilled at the host looks; its tail in
smaller batches, ``DecodeRun.shrink``), once as that call with the tail kept in the whole batch, and once as
consecutive calls of ``--slots`` requests (each runs until its longest request ends). Prints JSON: forwards,
row-forwards (the rows of the batch each forward ran: the decode work paid, as a step's cost grows with its
rows), prefill calls and tokens of each, the slot utilisation (tokens / (forwards x slots)), the row
utilisation (tokens / row-forwards), and the wall time and output tokens/s of each, timed after an untimed run of
the same calls (which captures the decode steps on CUDA, as a long-lived engine has them).

    PYTHONPATH=. python scripts/engine_refill_steps.py --slots 16 --requests-per-slot 4          # CPU, tiny shape
    PYTHONPATH=. python scripts/engine_refill_steps.py --shape qwen3-0.6b --device cuda --prompt-len 128 \
        --slots 128 --median 128 --max-new-tokens 1024   # the bench's long-tail call at batch 128, on a GPU
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from rlrun.engine.embedded import decode_run
from rlrun.engine.embedded.decode_graphs import WarmBatch
from rlrun.engine.embedded.engine import EmbeddedEngine
from rlrun.tools.bench.engines import LongTail
from rlrun.tools.bench.shapes import get_shape, write_random_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--requests-per-slot", type=int, default=4)
    parser.add_argument("--median", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", type=Path, help="Also write the JSON here.")
    args = parser.parse_args()
    workload = LongTail(args.requests_per_slot, args.median, 1.0, args.max_new_tokens)
    num_requests = args.requests_per_slot * args.slots
    lengths = workload.lengths(num_requests, seed=0)
    shape = get_shape(args.shape)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, min(512, shape.vocab), (num_requests, args.prompt_len), generator=generator).tolist()
    params = [
        {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": k, "ignore_eos": True} for k, n in enumerate(lengths)
    ]
    counts = {"forwards": 0, "row_forwards": 0, "prefills": 0}
    run = WarmBatch.run

    def counting(warm, length):
        counts["forwards"] += 1
        counts["row_forwards"] += warm.batch.num_rows
        run(warm, length)

    WarmBatch.run = counting  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
        model = write_random_model(shape, Path(tmp), getattr(torch, dtype), args.device)
        engine = EmbeddedEngine(model, dtype=dtype, device=args.device, max_running_requests=args.slots)
        prefill = engine._prefill

        def counting_prefill(batch):
            counts["prefills"] += 1
            return prefill(batch)

        engine._prefill = counting_prefill  # type: ignore[method-assign]
        report = {
            "shape": args.shape,
            "device": str(engine.device),
            "slots": args.slots,
            "requests": num_requests,
            "max_new_tokens_sum": sum(lengths),
        }
        shrink, whole = decode_run.SHRINK_MIN_ROWS, num_requests + 1  # SHRINK_MIN_ROWS: the default, or never
        for name, calls, min_rows in (
            ("refilled", [slice(0, num_requests)], shrink),
            ("refilled_whole_tail", [slice(0, num_requests)], whole),
            ("in_batches", [slice(s, s + args.slots) for s in range(0, num_requests, args.slots)], whole),
        ):
            decode_run.SHRINK_MIN_ROWS = min_rows
            for _ in range(2):  # the first run captures; the second is counted and timed
                counts.update(forwards=0, row_forwards=0, prefills=0)
                engine.synchronize()
                start = time.perf_counter()
                tokens = sum(r["completion_tokens"] for c in calls for r in engine.generate(prompts[c], params[c]))
                engine.synchronize()
                wall_s = time.perf_counter() - start
            report[name] = {
                **counts,
                "tokens": tokens,
                "slot_utilisation": tokens / (counts["forwards"] * args.slots),
                "row_utilisation": tokens / counts["row_forwards"],
                "wall_s": wall_s,
                "tokens_per_s": tokens / wall_s,
            }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
