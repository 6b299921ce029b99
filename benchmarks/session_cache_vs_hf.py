"""The embedded engine with and without the session cache against a Hugging Face forward, over five chat turns.

SmolLM2-135M-Instruct in fp32 on CPU, each turn 48 sampled tokens (temperature 1, seeded) after template-like tokens.
Per turn: the engine call's largest log-prob difference from an HF forward over the prompt and response, for the
engine without and with ``session_cache_size``; how many leading tokens the two sampled alike and, where they part,
the log-prob each gave its own token there (a draw from the far tail, where the sampler's cumulative sum is at fp32
resolution, is where a 1e-5 difference can pick another token). Each side continues its own conversation.

    python benchmarks/session_cache_vs_hf.py [--model .cache/models/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlrun.engine.embedded.engine import EmbeddedEngine

FIRST = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 35, 25, 45, 47, 2, 198, 1]
FIRST += [520, 9531, 198]
LATER = [2, 198, 1, 4093, 198, 36, 35, 43, 2, 198, 1, 520, 9531, 198]
"""SmolLM2 chat-template tokens: a system and a user turn, then per later turn the end of the model's turn, a short
user turn and the next assistant header."""


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    engines = {
        "plain": EmbeddedEngine(args.model, seed=0),
        "cached": EmbeddedEngine(args.model, seed=0, session_cache_size=4),
    }
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    prompts = {name: [] for name in engines}
    for turn in range(args.turns):
        row, results = {"turn": turn + 1}, {}
        for name, engine in engines.items():
            prompts[name] = prompts[name] + (FIRST if turn == 0 else LATER)
            params = {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 100 + turn, "session": "s"}
            (result,) = engine.generate([prompts[name]], params)
            want = hf_logprobs(reference, prompts[name], result["output_ids"])
            row[f"{name}_vs_hf"] = (torch.tensor(result["output_logprobs"]) - want).abs().max().item()
            row[f"{name}_prompt_tokens"] = len(prompts[name])
            results[name] = result
            prompts[name] = prompts[name] + result["output_ids"]
        a, b = results["plain"], results["cached"]
        pairs = list(zip(a["output_ids"], b["output_ids"], strict=False))
        same = next((i for i, (x, y) in enumerate(pairs) if x != y), len(pairs))
        row.update(cached_tokens=b["cached_tokens"], same_leading_tokens=same)
        if same < len(pairs):
            row.update(
                plain_logprob_at_split=a["output_logprobs"][same], cached_logprob_at_split=b["output_logprobs"][same]
            )
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
