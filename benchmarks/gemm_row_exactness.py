"""Whether a decode step's projections round each output as the trainer's do at a model shape's widths.

Why (docs/on_policy.md): the embedded engine's log-probs are the trainer's only if every op gives a token's
row the same bits in both. A projection is ``x @ W.T`` at M = the decode batch in the engine and M = a micro-batch's
tokens in the trainer; cuBLAS picks its kernel by shape, and a split-K kernel (the Qwen3-1.7B decode profile shows one
a layer at M = 64, benchmarks/results/decode_profile_qwen3-1.7b_b64_75a0e49_h200.txt) sums each output's K in another
order. The on-policy gates run SmolLM2 and a tiny Qwen3, whose widths may never pick one. This measures, for each
projection of a shape (the fused q/k/v and gate/up both sides run, the output and down projections, the LM head), the
elements of ``X[:M] @ W.T`` that differ from the same rows of ``X @ W.T`` at the trainer's M, with cuBLAS's reduced-
precision split-K reductions allowed (torch's default) and not, and each decode GEMM's time.

On the H200 (2026-12-04, benchmarks/results/gemm_row_exactness_h200.json) the down projection (and 4B's output
projection) rounded apart at decode M. A zero cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG=:0:0``, read when the
process first uses cuBLAS) leaves cuBLAS no split-K kernel; whether it
makes the rows bitwise, and what it costs, takes two runs: the first saves the trainer's rows under the default
workspace (``--save-rows``), the second, with the variable set, compares its decode rows with them
(``--against-rows``: the engine alone without a workspace) as well as with its own trainer GEMM (both sides without):

    PYTHONPATH=$PWD python3 benchmarks/gemm_row_exactness.py --out benchmarks/results/gemm_row_exactness_h200.json \
        --save-rows /tmp/rows.pt
    CUBLAS_WORKSPACE_CONFIG=:0:0 PYTHONPATH=$PWD python3 benchmarks/gemm_row_exactness.py \
        --out benchmarks/results/gemm_row_exactness_workspace0_h200.json --against-rows /tmp/rows.pt

The engine also runs its projections at a prefill's M (prompts x prompt length, or a chunk of it), and the trainer
its LM head at a chunk's M (~1,766 tokens of Qwen3's vocabulary, ``rlrun.megatron.token_stats.CHUNK_BYTES``):
``--rows`` sets the engine's M values, ``--tokens`` the trainer's, ``--only`` the projections (e.g. ``--rows 16384
--only qkv,o,gate_up,down``; ``--tokens 1766 --only lm_head``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from decode_attention import graph_timed_us  # benchmarks/, the script's folder

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


def differing(
    k: int, n: int, tokens: int, device: str, dtype: torch.dtype, saved: torch.Tensor | None, engine_rows: list[int]
) -> tuple[dict, torch.Tensor]:
    """Elements of each engine batch's rows (``engine_rows``: M values) that differ from the trainer's GEMM of
    ``tokens`` rows (and from ``saved``, another run's trainer rows, where given), each engine GEMM's time; and the
    trainer's first rows."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype)
    trained = torch.nn.functional.linear(x, w)
    saved = None if saved is None else saved.to(device)
    out: dict = {}
    for m in engine_rows:
        rows = x[:m].clone()
        decoded = torch.nn.functional.linear(rows, w)
        out[f"m{m}"] = int((decoded != trained[:m]).sum())
        if saved is not None:
            out[f"m{m}_vs_saved"] = int((decoded != saved[:m]).sum())
        if rows.is_cuda:  # captured, as the engine's decode step is
            out[f"m{m}_us"] = round(graph_timed_us(lambda rows=rows: torch.nn.functional.linear(rows, w), 50), 2)
    return out, trained[: max(engine_rows)].cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20480, help="the trainer's M (a micro-batch's tokens)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--rows",
        default=",".join(map(str, DECODE_ROWS)),
        help="the engine's M values: decode batches (the default), or a prefill's tokens (prompts x prompt length)",
    )
    parser.add_argument("--only", help="comma-separated projections: qkv, o, gate_up, down, lm_head (default: all)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--save-rows", help="write the trainer's first rows of every GEMM here (torch.save)")
    parser.add_argument("--against-rows", help="also compare the decode rows with a --save-rows file's")
    args = parser.parse_args()
    dtype = torch.bfloat16
    record: dict = {"benchmark": "gemm_row_exactness", "command": "python3 " + " ".join(sys.argv)}
    record["torch"] = torch.__version__
    record["hardware"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    record["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    names = set(projections(*SHAPES["qwen3-0.6b"]))
    only = set(args.only.split(",")) if args.only else names
    if not only <= names:
        parser.error(f"--only ({args.only}) must name projections among {sorted(names)}")
    engine_rows = [int(m) for m in args.rows.split(",")]
    if max(engine_rows) > args.tokens:
        parser.error(
            f"--rows ({args.rows}) must be at most --tokens ({args.tokens}): they are the trainer's first rows"
        )
    record["tokens"], record["engine_rows"], record["results"] = args.tokens, engine_rows, {}
    against = torch.load(args.against_rows) if args.against_rows else {}
    rows: dict[str, torch.Tensor] = {}
    matmul = torch.backends.cuda.matmul
    kept = matmul.allow_bf16_reduced_precision_reduction
    try:
        for reduced in (True, False):
            matmul.allow_bf16_reduced_precision_reduction = reduced
            for shape in args.shapes.split(","):
                for name, (k, n) in projections(*SHAPES[shape]).items():
                    if name not in only:
                        continue
                    key = f"{shape}/{name}/reduced_precision_reduction_{reduced}"
                    saved = against.get(key)
                    counts, rows[key] = differing(k, n, args.tokens, args.device, dtype, saved, engine_rows)
                    record["results"][key] = {"k": k, "n": n, **counts}
                    print(key, record["results"][key], flush=True)
    finally:
        matmul.allow_bf16_reduced_precision_reduction = kept
    if args.save_rows:
        torch.save(rows, args.save_rows)
    with open(args.out, "w") as handle:
        handle.write(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
