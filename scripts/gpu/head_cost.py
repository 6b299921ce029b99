"""What the trainer's LM head and its log-prob/entropy statistics cost on one micro-batch (GPU, one process).

Times forward + backward of ``chunked_head_token_stats`` (``model.lm_head: chunked``) and of the stored-logits
path (``lm_head: logits``) on hidden states ``[tokens, H]`` of a Qwen3 shape, with the per-piece passes as Triton
kernels (the CUDA default) and as eager PyTorch (the CPU path), against the three bare GEMMs the head needs
(forward, and the two of the backward), so the elementwise share shows. Prints JSON.

    python scripts/gpu/head_cost.py --tokens 20480 --hidden 1024 --vocab 151936 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlrun.megatron import token_stats
from rlrun.megatron.token_stats import chunked_head_token_stats, chunked_token_stats


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of ``fn`` after one warm-up, CUDA-synchronised."""
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # the stats' all-reduces are skipped on a group of one rank, but need a process group to ask
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    hidden = (torch.randn(args.tokens, args.hidden, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=dev)

    def head(with_grad: bool, logits_path: bool):
        def run() -> None:
            hidden.grad = weight.grad = None
            if logits_path:
                logp, ent = chunked_token_stats(hidden @ weight.t(), targets, 1.0, 0, args.vocab, None)
            else:
                logp, ent = chunked_head_token_stats(hidden, weight, targets, 1.0, 0, args.vocab, None)
            if with_grad:
                (logp.sum() + 0.01 * ent.sum()).backward()

        return run

    def gemms() -> None:
        with torch.no_grad():
            logits = hidden @ weight.t()
            _ = logits @ weight
            _ = logits.t() @ hidden

    record = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "gemms_3_s": timed(gemms)}
    triton_covers = token_stats._triton_covers
    for passes in ("triton", "eager"):
        token_stats._triton_covers = triton_covers if passes == "triton" else (lambda u: False)
        record[f"{passes}_chunked_forward_s"] = timed(head(False, False))
        record[f"{passes}_chunked_forward_backward_s"] = timed(head(True, False))
        record[f"{passes}_logits_forward_backward_s"] = timed(head(True, True))
    record.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
