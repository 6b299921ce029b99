"""Rollout-phase seconds with partial rollout on vs off, where the slowest group is 4x longer.

Two real ranks (gloo) run ``RolloutRuntime.collect`` for ``--steps`` steps against a simulated engine whose
cost is real time: each call writes one token per ``--token-s`` seconds to all its rows at once (a batching
engine), every fifth prompt's response is 4x the others' (80 vs 20 tokens), and ``abort`` ends the calls
in flight with what they have. Three settings, one after another on the same prompts: waiting for every
group (the default rounds), ``rollout.abort_surplus`` and ``rollout.partial_rollout``; 4 groups trained per
step out of 8 drawn per round, 2 samples each. Also counts, for partial rollout, that every drawn group
was trained exactly once or is still carried (``groups_dropped``: drawn, neither trained nor carried;
the surplus the other two settings generate and drop by design). Writes one JSON (``--out``) and prints it.

    torchrun --standalone --nproc-per-node 2 benchmarks/partial_rollout_timing.py \\
        --out benchmarks/results/partial_rollout_timing_cpu.json

``--model``: any HF directory with a tokenizer (default: the quickstart's SmolLM2; ``rlrun prepare smollm2``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

FAST_TOKENS, SLOW_TOKENS = 20, 80
NUM_ROWS = 120
ROLLOUT = {"prompts_per_step": 4, "over_sampling_prompts": 8, "samples_per_prompt": 2, "max_new_tokens": 200}
SETTINGS = {"wait_for_all": {}, "abort_surplus": {"abort_surplus": True}, "partial_rollout": {"partial_rollout": True}}


def response_of(row: int) -> list[int]:
    return [10 + (row * 7 + k) % 200 for k in range(SLOW_TOKENS if row % 5 == 0 else FAST_TOKENS)]


class TimedEngine:
    """One token per ``token_s`` per call, all calls in parallel; continuations pick up where the input ends."""

    def __init__(self, rows: dict[tuple[int, ...], int], token_s: float):
        self.rows, self.token_s, self.lock, self.inflight = rows, token_s, threading.Lock(), []
        self.prompt_lengths = sorted({len(p) for p in rows})

    def _row_of(self, ids: list[int]) -> tuple[int, int]:
        for n in self.prompt_lengths:
            if tuple(ids[:n]) in self.rows:
                return self.rows[tuple(ids[:n])], len(ids) - n
        raise AssertionError("an input starts with no known prompt")

    def generate(self, input_ids, sampling_params, return_logprob=True, rids=None):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        flag = threading.Event()
        with self.lock:
            self.inflight.append(flag)
        todo = []
        for ids, p in zip(input_ids, params, strict=True):
            row, written = self._row_of(ids)
            todo += [response_of(row)[written:][: p["max_new_tokens"]]] * p["n"]
        made = 0
        while made < max(len(t) for t in todo) and not flag.is_set():
            time.sleep(self.token_s)
            made += 1
        with self.lock:
            self.inflight.remove(flag)
        out = []
        for tokens in todo:
            done = made >= len(tokens)
            reason = {"type": "stop", "matched": tokens[-1]} if done else {"type": "abort", "message": "Aborted"}
            out.append(
                {
                    "output_ids": tokens[:made],
                    "output_logprobs": [-1.0] * min(made, len(tokens)),
                    "finish_reason": reason,
                    "weight_version": "0",
                }
            )
        return out

    def abort(self, rid="", abort_all=False):
        with self.lock:
            for flag in self.inflight:
                flag.set()


def run_setting(name: str, args, data: Path, reward: str, parallel) -> dict | None:
    from transformers import AutoTokenizer

    from rlrun.config.schema import RunConfig
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.rollout.collect import RolloutRuntime

    cfg = RunConfig.model_validate(
        {
            "model": {"path": args.model},
            "data": {"path": str(data), "apply_chat_template": False, "shuffle": False},
            "rollout": {**ROLLOUT, "reward": reward, **SETTINGS[name]},
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = PromptDataset(cfg.data, tokenizer)
    sampler = PromptSampler(dataset, seed=0, shuffle=False) if parallel.is_rank0 else None
    engine = TimedEngine({tuple(p.prompt_ids): p.index for p in dataset.prompts}, args.token_s)
    runtime = RolloutRuntime.build(cfg, parallel, engine, tokenizer, sampler)
    seconds, trained, tokens_saved = [], [], 0
    for step in range(args.steps):
        start = time.perf_counter()
        batch = runtime.collect(step)
        seconds.append(round(time.perf_counter() - start, 3))
        if batch is not None:
            trained += [s.group_index for s in batch.samples[:: ROLLOUT["samples_per_prompt"]]]
            tokens_saved += int(batch.metrics.get("rollout/tokens_saved", 0))
    if sampler is None:
        return None
    carried = {g[0].group_index for g in runtime.carry}
    drawn = set(range(sampler.state_dict()["position"]))
    return {
        "setting": name,
        "rollout_s": round(sum(seconds), 3),
        "rollout_s_per_step": seconds,
        "groups_trained": len(trained),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "groups_drawn": len(drawn),
        "groups_dropped": len(drawn - set(trained) - carried),
        "groups_carried_at_end": len(carried),
        "tokens_saved": tokens_saved,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--token-s", type=float, default=0.01, help="seconds per generated token")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch.distributed as dist

    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, 0)
    try:
        with tempfile.TemporaryDirectory() as tmp:  # each rank writes the same two files
            data, hooks = Path(tmp) / "p.jsonl", Path(tmp) / "reward.py"
            data.write_text("".join(json.dumps({"prompt": f"row {i}:", "label": i}) + "\n" for i in range(NUM_ROWS)))
            hooks.write_text("def reward(sample):\n    return 1.0\n")
            results = [run_setting(name, args, data, f"{hooks}:reward", parallel) for name in SETTINGS]
            dist.barrier(group=parallel.cpu_group)
    finally:
        destroy_distributed()
    if not parallel.is_rank0:
        return
    record = {
        "benchmark": "partial_rollout_timing",
        "command": " ".join(
            ["torchrun --standalone --nproc-per-node 2 benchmarks/partial_rollout_timing.py", *sys.argv[1:]]
        ),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "engine": f"simulated, {args.token_s} s/token, every fifth prompt {SLOW_TOKENS} tokens, others {FAST_TOKENS}",
        "rollout": ROLLOUT,
        "results": results,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
