"""Seconds per step and samples/s of the synchronous loop (``rollout.max_staleness`` 0) against rollouts
generated 1 and 2 steps ahead, and 2 ahead continued across an update past a token boundary
(``rollout.continue_after_tokens``: half the budget, and the median length), with long-tailed response lengths.

One process (a gloo group of one rank) runs the real rollout side, ``RolloutRuntime.collect`` on its own
process group driven by ``RolloutAhead`` (rlrun/rollout/ahead.py), against a simulated batching engine whose
cost is real time: a call writes one token per ``--token-s`` seconds to all its rows at once, so it lasts as
long as its longest response. Response lengths are log-normal (median 24 tokens, sigma 1, capped at 256), so
a few steps wait for a response ten times the median. The trainer is simulated too: a step's training
sleeps ``--train-s-per-token`` seconds per response token of its batch (the same work in every setting, since
every setting trains the same prompts' same responses), and each sync costs ``--sync-s``. With continuation
the engine writes the first N tokens under one version, and the responses cut there continue in a second call
(it costs its longest remainder; the real engine's prefill of prompt + the tokens so far is not simulated)
under the next version. Every row also reports, once the pipeline is full, ``rollout/versions_behind_mean``
(per sample over its tokens, then over the batch) and the share of response tokens sampled by a newer version
than their sample's first token. Writes one JSON (``--out``) and prints it.

    python benchmarks/async_timing.py --out benchmarks/results/async_timing_continued_cpu.json

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
    """A batching engine: one call lasts ``token_s`` x the most tokens it writes to a row. Row k of a prompt
    writes token ``1000 + k``, so a continuation (prompt + tokens so far) names its sample."""

    def __init__(self, rows: dict[tuple[int, ...], int], token_s: float):
        self.rows, self.token_s = rows, token_s
        self.prompt_lengths = sorted({len(ids) for ids in rows})
        self.version = "0"

    def generate(self, input_ids, sampling_params, return_logprob=True, rids=None):
        per_input = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        rows = []
        for ids, params in zip(input_ids, per_input, strict=True):
            prompt_len = next(n for n in self.prompt_lengths if tuple(ids[:n]) in self.rows)
            row, done = self.rows[tuple(ids[:prompt_len])], len(ids) - prompt_len
            for k in range(params["n"]) if done == 0 else [ids[-1] - 1000]:
                left = response_length(row, k) - done
                rows.append((k, min(left, params["max_new_tokens"]), left))
        time.sleep(self.token_s * max((num for _, num, _ in rows), default=0))
        return [
            {
                "output_ids": [1000 + k] * num,
                "output_logprobs": [-1.0] * num,
                "finish_reason": {"type": "stop" if num == left else "length"},
                "weight_version": self.version,
            }
            for k, num, left in rows
        ]


def run_setting(max_staleness: int, continue_after: int | None, args, data: Path, reward: str, parallel) -> dict:
    import dataclasses

    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlrun.config.schema import RunConfig
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.rollout.ahead import Published, RolloutAhead, versions_behind
    from rlrun.rollout.collect import RolloutRuntime
    from rlrun.rollout.segments import SegmentedGeneration

    cfg = RunConfig.model_validate(
        {
            "model": {"path": args.model},
            "data": {"path": str(data), "apply_chat_template": False, "shuffle": False},
            "rollout": {
                **ROLLOUT,
                "reward": reward,
                "max_staleness": max_staleness,
                "continue_after_tokens": continue_after,
            },
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

    tokens, behind, newer, full_tokens, start = 0, [], 0, 0, time.perf_counter()

    def account(step: int, samples) -> None:
        nonlocal tokens, newer, full_tokens
        tokens += sum(len(s.response_ids) for s in samples)
        spans = [s.weight_spans or [(s.weight_version, len(s.response_ids))] for s in samples]
        if step >= max_staleness:  # once the pipeline is full
            behind.append(versions_behind(step, spans)["rollout/versions_behind_mean"])
            newer += sum(n for sample_spans in spans for v, n in sample_spans if v != sample_spans[0][0])
            full_tokens += sum(len(s.response_ids) for s in samples)

    if max_staleness == 0:
        for step in range(args.steps):
            samples = runtime.collect(step).samples
            train(samples)
            push(Published(step + 1, None))
            account(step, samples)
    else:  # the schedule of rlrun/trainer/ahead_step.py
        group = dist.new_group(backend="gloo")
        ahead = RolloutAhead(lambda step: collect(step), push, max_staleness, 0, end_step=args.steps)
        segments = SegmentedGeneration(ahead.enter_segment) if continue_after else None
        thread_parallel = dataclasses.replace(parallel, cpu_group=group)
        ahead_runtime = dataclasses.replace(runtime, parallel=thread_parallel, segments=segments)

        def collect(step: int):
            if segments is not None:
                segments.start(step)
            return ahead_runtime.collect(step)

        for step in range(args.steps):
            ahead.launch_until(step)
            samples = ahead.take(step).samples
            train(samples)
            ahead.publish(step, Published(step + 1, None))
            account(step, samples)
        ahead.close()
    seconds = time.perf_counter() - start
    num_samples = args.steps * ROLLOUT["prompts_per_step"] * ROLLOUT["samples_per_prompt"]
    return {
        "max_staleness": max_staleness,
        "continue_after_tokens": continue_after,
        "seconds": round(seconds, 3),
        "seconds_per_step": round(seconds / args.steps, 3),
        "samples_per_s": round(num_samples / seconds, 3),
        "response_tokens": tokens,
        "versions_behind_mean": round(sum(behind) / len(behind), 3),
        "newer_token_share": round(newer / full_tokens, 3),
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
            settings = [(0, None), (1, None), (2, None), (2, MAX_TOKENS // 2), (2, MEDIAN_TOKENS)]
            results = [run_setting(k, c, args, data, f"{hooks}:reward", parallel) for k, c in settings]
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
