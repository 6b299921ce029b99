"""Device memory one NCCL communicator holds, and whether destroying its group gives it back.

Why: after training, a sleeping trainer still holds ~1.8 GB outside torch's pools; Megatron
creates one NCCL communicator per process group it uses (TP, DP, model-parallel, embedding, ...).

    python benchmarks/nccl_comm_memory.py --groups 4 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def used_gb() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 1e9, 4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(0)
    x = torch.ones(1024, device="cuda")
    before_init = used_gb()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    dist.all_reduce(x)
    after_world = used_gb()
    groups = [dist.new_group([0]) for _ in range(args.groups)]
    for group in groups:
        dist.all_reduce(x, group=group)
    after_groups = used_gb()
    for group in groups:
        dist.destroy_process_group(group)
    after_destroy = used_gb()
    out = {
        "groups": args.groups,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
        "used_gb": {
            "cuda_context": before_init,
            "world_comm": after_world,
            "plus_groups": after_groups,
            "groups_destroyed": after_destroy,
        },
        "per_communicator_gb": round((after_groups - after_world) / args.groups, 4),
        "freed_by_destroy_gb": round(after_groups - after_destroy, 4),
    }
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
