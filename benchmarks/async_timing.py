"""Seconds per step and samples/s of the synchronous loop (``rollout.max_staleness`` 0) against rollouts
generated 1 and 2 steps ahead, with long-tailed response lengths.

One process (a gloo group of one rank) runs the real rollout side, ``RolloutRuntime.collect`` on its own
process group driven by ``RolloutAhead`` (rlrun/rollout/ahead.py), against a simulated batching engine whose
cost is real time: a call writes one token per ``--token-s`` seconds to all its rows at once, so it lasts as
long as its longest response. Response lengths are log-normal (median 24 tokens, sigma 1, capped at 256), so
a few steps wait for a response ten times the median. The trainer is simulated too: a step's training
sleeps ``--train-s-per-token`` seconds per response token of its batch (the same work in every setting, since
every setting trains the same prompts' same responses), and each sync costs ``--sync-s``. Writes one JSON
(``--out``) and prints it.

    python benchmarks/async_timing.py --out benchmarks/results/async_timing_cpu.json

``--model``: any HF directory with a tokenizer (default: the quickstart's SmolLM2; ``rlrun prepare smollm2``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

NUM_ROWS = 400
MEDIAN_TOKENS, SIGMA, MAX_TOKENS = 24, 1.0, 256
ROLLOUT = {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": MAX_TOKENS}


def response_length(row: int, sample: int) -> int:
    """Log-normal, fixed per (prompt row, sample index): every setting generates the same responses."""
    draw = random.Random(row * 1_000 + sample).gauss(0.0, SIGMA)
    return max(1, min(MAX_TOKENS, round(MEDIAN_TOKENS * math.exp(draw))))


class LongTailEngine:
    """A batching engine: one call lasts ``token_s`` x its longest response."""

    def __init__(self, rows: dict[tuple[int, ...], int], token_s: float):
        self.rows, self.token_s = rows, token_s
        self.version = "0"

    def generate(self, input_ids, sampling_params, return_logprob=True, rids=None):
        n = sampling_params["n"]
        lengths = [response_length(self.rows[tuple(ids)], k) for ids in input_ids for k in range(n)]
        time.sleep(self.token_s * max(lengths, default=0))
        return [
            {
                "output_ids": [11] * length,
                "output_logprobs": [-1.0] * length,
                "finish_reason": {"type": "length"},
                "weight_version": self.version,
            }
            for length in lengths
        ]


def run_setting(max_staleness: int, args, data: Path, reward: str, parallel) -> dict:
    import dataclasses

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlrun.config.schema import RunConfig
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.rollout.ahead import Published, RolloutAhead
    from rlrun.rollout.collect import RolloutRuntime

    cfg = RunConfig.model_validate(
        {
            "model": {"path": args.model},
            "data": {"path": str(data), "apply_chat_template": False, "shuffle": False},
            "rollout": {**ROLLOUT, "reward": reward, "max_staleness": max_staleness},
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = PromptDataset(cfg.data, tokenizer)
    engine = LongTailEngine({tuple(p.prompt_ids): p.index for p in dataset.prompts}, args.token_s)
    sampler = PromptSampler(dataset, seed=0, shuffle=False)
    runtime = RolloutRuntime.build(cfg, parallel, engine, tokenizer, sampler)

    def train(samples) -> None:  # the simulated trainer, then the sync's export
        time.sleep(args.train_s_per_token * sum(len(s.response_ids) for s in samples) + args.sync_s)

    def push(published: Published) -> None:
        engine.version = str(published.version)

    tokens, start = 0, time.perf_counter()
    if max_staleness == 0:
        for step in range(args.steps):
            samples = runtime.collect(step).samples
            train(samples)
            push(Published(step + 1, None))
            tokens += sum(len(s.response_ids) for s in samples)
    else:
        group = dist.new_group(backend="gloo")
        ahead_runtime = dataclasses.replace(runtime, parallel=dataclasses.replace(parallel, cpu_group=group))
        ahead = RolloutAhead(ahead_runtime.collect, push, max_staleness, 0, end_step=args.steps)
        for step in range(args.steps):
            ahead.launch_until(step)
            samples = ahead.take(step).samples
            train(samples)
            ahead.publish(step, Published(step + 1, None))
            tokens += sum(len(s.response_ids) for s in samples)
        ahead.close()
    seconds = time.perf_counter() - start
    num_samples = args.steps * ROLLOUT["prompts_per_step"] * ROLLOUT["samples_per_prompt"]
    return {
        "max_staleness": max_staleness,
        "seconds": round(seconds, 3),
        "seconds_per_step": round(seconds / args.steps, 3),
        "samples_per_s": round(num_samples / seconds, 3),
        "response_tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--token-s", type=float, default=0.004, help="seconds per generated token (per call)")
    parser.add_argument("--train-s-per-token", type=float, default=0.0008, help="simulated training seconds")
    parser.add_argument("--sync-s", type=float, default=0.02, help="simulated weight export seconds per step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, 0)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data, hooks = Path(tmp) / "p.jsonl", Path(tmp) / "reward.py"
            data.write_text("".join(json.dumps({"prompt": f"row {i}:", "label": i}) + "\n" for i in range(NUM_ROWS)))
            hooks.write_text("def reward(sample):\n    return 1.0\n")
            results = [run_setting(k, args, data, f"{hooks}:reward", parallel) for k in (0, 1, 2)]
    finally:
        destroy_distributed()
    base = results[0]["samples_per_s"]
    for result in results:
        result["speedup_vs_sync"] = round(result["samples_per_s"] / base, 3)
    assert len({r["response_tokens"] for r in results}) == 1, "the settings generated different work"
    record = {
        "benchmark": "async_timing",
        "command": " ".join(["python benchmarks/async_timing.py", *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "engine": (
            f"simulated batching engine, {args.token_s} s/token per call; response lengths log-normal "
            f"(median {MEDIAN_TOKENS}, sigma {SIGMA}, cap {MAX_TOKENS})"
        ),
        "trainer": f"simulated, {args.train_s_per_token} s per response token + {args.sync_s} s sync per step",
        "rollout": ROLLOUT,
        "steps": args.steps,
        "results": results,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
