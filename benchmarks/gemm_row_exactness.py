"""Whether a decode step's projections round each output as the trainer's do at a model shape's widths.

Why (issue 29, docs/on_policy.md): the embedded engine's log-probs are the trainer's only if every op gives a token's
row the same bits in both. A projection is ``x @ W.T`` at M = the decode batch in the engine and M = a micro-batch's
tokens in the trainer; cuBLAS picks its kernel by shape, and a split-K kernel (the Qwen3-1.7B decode profile shows one
a layer at M = 64, benchmarks/results/decode_profile_qwen3-1.7b_b64_75a0e49_h200.txt) sums each output's K in another
order. The on-policy gates run SmolLM2 and a tiny Qwen3, whose widths may never pick one. This measures, for each
projection of a shape (the fused q/k/v and gate/up both sides run, the output and down projections, the LM head), the
elements of ``X[:M] @ W.T`` that differ from the same rows of ``X @ W.T`` at the trainer's M, with cuBLAS's reduced-
precision split-K reductions allowed (torch's default) and not.

    PYTHONPATH=$PWD python3 benchmarks/gemm_row_exactness.py --out benchmarks/results/gemm_row_exactness_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPES = {
    "qwen3-0.6b": (1024, 2048, 1024, 3072),
    "qwen3-1.7b": (2048, 2048, 1024, 6144),
    "qwen3-4b": (2560, 4096, 1024, 9728),
}
"""hidden, query width (heads x 128), key-value width, MLP width."""
VOCAB = 151936
DECODE_ROWS = (1, 16, 64, 128)


def projections(hidden: int, query: int, kv: int, mlp: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each GEMM a layer (and the head) runs."""
    return {
        "qkv": (hidden, query + 2 * kv),
        "o": (query, hidden),
        "gate_up": (hidden, 2 * mlp),
        "down": (mlp, hidden),
        "lm_head": (hidden, VOCAB),
    }


def differing(k: int, n: int, tokens: int, device: str, dtype: torch.dtype) -> dict[str, int]:
    """Elements of each decode batch's rows that differ from the trainer's GEMM of ``tokens`` rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype)
    trained = torch.nn.functional.linear(x, w)
    return {f"m{m}": int((torch.nn.functional.linear(x[:m].clone(), w) != trained[:m]).sum()) for m in DECODE_ROWS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20480, help="the trainer's M (a micro-batch's tokens)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dtype = torch.bfloat16
    record: dict = {"benchmark": "gemm_row_exactness", "command": "python3 " + " ".join(sys.argv)}
    record["torch"] = torch.__version__
    record["hardware"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    record["tokens"], record["results"] = args.tokens, {}
    matmul = torch.backends.cuda.matmul
    kept = matmul.allow_bf16_reduced_precision_reduction
    try:
        for reduced in (True, False):
            matmul.allow_bf16_reduced_precision_reduction = reduced
            for shape in args.shapes.split(","):
                for name, (k, n) in projections(*SHAPES[shape]).items():
                    key = f"{shape}/{name}/reduced_precision_reduction_{reduced}"
                    record["results"][key] = {"k": k, "n": n, **differing(k, n, args.tokens, args.device, dtype)}
                    print(key, record["results"][key], flush=True)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = kept
    with open(args.out, "w") as handle:
        handle.write(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
