"""verl's log-prob fallback against the one benchmarks/verl_plugins.py puts in its place: seconds and agreement.

Without the flash-attn package (no wheel for the GPU machine's torch 2.11 / CUDA 13), verl 0.9.1 computes a
packed row's log-probs with ``verl.utils.torch_functional.logprobs_from_logits_v2``, a Python loop over the
row's tokens. verl_plugins.py replaces it with ``logprobs_of_labels`` (fp32 cross-entropy in one call, what
flash-attn's kernel returns). This times both, forward and backward, on one micro-batch of verl_grpo.py's
work (``--tokens`` = its token budget, 32 samples of 640 tokens; ``--vocab`` = Qwen3's), and reports how far
apart their log-probs and logit gradients are.

Both functions are taken from the code that runs: verl's from its wheel (``--verl-wheel``; importing verl
itself needs Ray), the replacement from verl_plugins.py (importing it registers it with verl). Each is
compiled from its own source text, alone, with ``torch`` and ``F`` in scope.

    python benchmarks/verl_logprob.py --verl-wheel .whl-verl/verl-0.9.1-py3-none-any.whl --out $OUT/verl_logprob.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
VERL_SOURCE = "verl/utils/torch_functional.py"


def function_from_source(source: str, name: str):
    """The top-level function ``name`` of ``source``, compiled alone with ``torch`` and ``F`` in scope."""
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise SystemExit(f"{name} is not a top-level function of the source given")
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=[node], type_ignores=[]), name, "exec"), namespace)
    return namespace[name]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, logits: torch.Tensor, labels: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Median seconds of forward + backward of ``fn(logits, labels).sum()``, and its log-probs and gradient."""
    seconds = []
    for _ in range(repeats):
        leaf = logits.detach().requires_grad_()
        synchronize(logits.device)
        start = time.perf_counter()
        out = fn(leaf, labels)
        out.float().sum().backward()
        synchronize(logits.device)
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2], out.detach().float(), leaf.grad.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verl-wheel", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=32 * 640)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu for a dry run of small shapes")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)

    with zipfile.ZipFile(args.verl_wheel) as wheel:
        verl_fallback = function_from_source(wheel.read(VERL_SOURCE).decode(), "logprobs_from_logits_v2")
    replacement = function_from_source((HERE / "verl_plugins.py").read_text(), "logprobs_of_labels")

    generator = torch.Generator(device=device).manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record: dict = {
        "benchmark": "verl_logprob",
        "tokens": args.tokens,
        "vocab": args.vocab,
        "device": name,
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "results": {},
    }
    for dtype in (torch.bfloat16, torch.float32):
        logits = (torch.randn(args.tokens, args.vocab, device=device, generator=generator) * 2).to(dtype)
        labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=generator)
        fallback_s, fallback_out, fallback_grad = timed(verl_fallback, logits, labels, args.repeats)
        mine_s, mine_out, mine_grad = timed(replacement, logits, labels, args.repeats)
        record["results"][str(dtype).removeprefix("torch.")] = {
            "verl_fallback_s": fallback_s,
            "replacement_s": mine_s,
            "speedup": fallback_s / mine_s,
            "max_abs_logprob_diff": (fallback_out - mine_out).abs().max().item(),
            "max_abs_grad_diff": (fallback_grad - mine_grad).abs().max().item(),
        }
        del logits, fallback_grad, mine_grad
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
