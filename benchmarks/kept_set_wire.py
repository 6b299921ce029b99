"""What a generate call's kept sets (top-p mask replay) cost on their way from the engine worker to the trainer rank.

Why: in ``rlrun bench rollout`` the embedded engine's sampled call (top-p 0.95) ran 92-98% of SGLang's
tokens/s at batch 64 through its worker, while the same engine in process ran 19,092 tok/s against the worker's 15,630
(Qwen3-0.6B shape, H200, 2026-12-03): the random model keeps 512 tokens a draw, so 64 responses of 256 tokens carry
33.5 MB of kept ids that SGLang, which returns none, does not move. This times that payload alone through rlrun's RPC
(a real ``RpcServer`` in another process, ZeroMQ over ipc, msgpack): the engine's encoding (:func:`encode_kept_rows`
on a ``[rows, tokens, 512]`` buffer), packing, the transfer, unpacking and the rollout driver's decoding, for the
wire form (bytes) and for base64 text (the form before 2026-12-03), each against the same call without kept sets.

    python3 benchmarks/kept_set_wire.py --out benchmarks/results/kept_set_wire_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from rlrun.engine.kept_set import decode_kept_ids, encode_kept_rows
from rlrun.engine.rpc import RpcClient, RpcServer

VOCAB = 151_936


_KEPT: dict[tuple[int, int, int], torch.Tensor] = {}
"""The engine's kept-set buffer per shape, drawn once (the draw is not the engine's cost)."""


def _results(rows: int, tokens: int, width: int, form: str) -> list[dict]:
    """A call's results as the worker builds them: ids, log-probs and (form 'bytes' / 'base64') kept sets."""
    results = [{"output_ids": list(range(tokens)), "output_logprobs": [-1.0] * tokens} for _ in range(rows)]
    if form != "none":
        if (rows, tokens, width) not in _KEPT:
            generator = torch.Generator().manual_seed(0)
            _KEPT[rows, tokens, width] = torch.randint(0, VOCAB, (rows, tokens, width), generator=generator)
        kept = _KEPT[rows, tokens, width]
        for result, wire in zip(results, encode_kept_rows(kept, [tokens] * rows), strict=True):
            if form == "base64":
                wire = {"data": base64.b64encode(wire["data"]).decode("ascii"), "width": wire["width"]}
            result["kept_ids"] = wire
    return results


def _serve(endpoint: str, ready) -> None:
    stop = threading.Event()

    def generate(rows: int, tokens: int, width: int, form: str) -> list[dict]:
        return _results(rows, tokens, width, form)

    def shutdown() -> None:
        stop.set()

    server = RpcServer(endpoint, {"generate": generate, "shutdown": shutdown})
    ready.set()
    asyncio.run(server.serve(stop))
    server.close()


def _decode(results: list[dict], form: str) -> None:
    """The rollout driver's decoding of each result's kept sets."""
    for result in results:
        if form == "base64":
            wire = result["kept_ids"]
            result["kept_ids"] = {"data": base64.b64decode(wire["data"]), "width": wire["width"]}
        if form != "none":
            decode_kept_ids(result["kept_ids"], len(result["output_ids"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='kw-')}/rpc"
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(endpoint, ready))
    server.start()
    ready.wait(60)
    client = RpcClient(endpoint, timeout_s=300)
    record: dict = {"benchmark": "kept_set_wire", "command": "python3 " + " ".join(sys.argv)}
    record.update(host=platform.node(), cpus=multiprocessing.cpu_count())
    record.update(rows=args.rows, tokens=args.tokens, width=args.width)
    try:
        for form in ("none", "bytes", "base64"):
            seconds = []
            for _ in range(args.repeats + 1):  # the first call warms up
                start = time.perf_counter()
                results = client.call("generate", rows=args.rows, tokens=args.tokens, width=args.width, form=form)
                _decode(results, form)
                seconds.append(time.perf_counter() - start)
            record[form] = {"median_s": sorted(seconds[1:])[len(seconds[1:]) // 2], "seconds": seconds[1:]}
        client.call("shutdown")
    finally:
        client.close()
        server.join(30)
    for form in ("bytes", "base64"):
        record[form]["kept_set_s"] = record[form]["median_s"] - record["none"]["median_s"]
    text = json.dumps(record, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
