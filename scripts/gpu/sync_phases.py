"""Where a colocated weight sync's time goes: the whole sync (``rlrun bench sync``'s measure) at several bucket sizes
against the trainer's side alone (the export and the packing of every bucket, nothing sent), on one trainer and one
embedded engine, one model. The difference is the transport and the engine's load. ``--profile FILE`` adds the torch
profiler's table of one more trainer-side pass at the first bucket size (what its time is spent on).

    PYTHONPATH=$PWD python3 scripts/gpu/sync_phases.py --shape qwen3-8b --bucket-mib 512,2048,4096 --out FILE
    PYTHONPATH=$PWD python scripts/gpu/sync_phases.py --shape tiny --bucket-mib 1,4 --out /tmp/sync_phases.json  # CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch


def _pack_only(model, bucket_bytes: int, device: torch.device) -> float:
    """Seconds for the trainer's side of one sync: every bucket exported and packed, then dropped."""
    from rlrun.engine.payload import _flatten, iter_buckets
    from rlrun.megatron import export_hf_weights
    from rlrun.tools.bench.timing import timer

    with timer(device) as seconds:
        for bucket in iter_buckets(export_hf_weights(model, fresh=False), bucket_bytes):
            _flatten(bucket)
    return seconds[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--bucket-mib", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--run-dir", type=Path, default=Path("/tmp/sync_phases"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=Path, default=None)
    args = parser.parse_args()

    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.tools.bench.sync import sync_once, trainer_and_engine
    from rlrun.tools.bench.timing import hardware

    args.run_dir.mkdir(parents=True, exist_ok=True)
    parallel = init_distributed(tp=1, pp=1, seed=0)
    device = parallel.device
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    rows = []
    with trainer_and_engine(args.shape, parallel, args.run_dir, dtype) as (model, engine):
        for mib in (int(m) for m in args.bucket_mib.split(",")):
            bucket_bytes = mib * 2**20
            syncs, packs = [], []
            for i in range(args.repeats + 1):  # the first of each is a warm-up
                stats, sync_s, _ = sync_once(engine, model, f"{mib}-{i}", bucket_bytes, device)
                syncs.append(sync_s)
                packs.append(_pack_only(model, bucket_bytes, device))
            row = {
                "bucket_mib": mib,
                "num_buckets": stats["num_buckets"],
                "weight_bytes": stats["num_bytes"],
                "sync_s": syncs[1:],
                "trainer_side_s": packs[1:],
                "sync_median_s": statistics.median(syncs[1:]),
                "trainer_side_median_s": statistics.median(packs[1:]),
            }
            row["transport_and_load_s"] = row["sync_median_s"] - row["trainer_side_median_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.profile is not None and len(rows) == 1:
                from rlrun.tools.bench.kernel_table import profiled, write_kernel_table

                write_kernel_table(profiled(lambda: _pack_only(model, bucket_bytes, device)), args.profile)
    destroy_distributed()
    record = {
        "benchmark": "sync_phases",
        "command": "python scripts/gpu/sync_phases.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "hardware": hardware(device),
        "shape": args.shape,
        "dtype": dtype,
        "results": rows,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
