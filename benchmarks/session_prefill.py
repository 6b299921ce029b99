"""Prefill tokens per turn of a 4-turn agent with and without the embedded engine's session cache.

The example's calculator agent shape (examples/openai_agent): a system turn, a question, three tool results, then
the answer, through the real agent server and ``openai`` client, on SmolLM2-135M-Instruct in fp32 on CPU. The model's
replies are sampled (seeded), the tool results fixed. Each turn reports its input tokens, the tokens the engine took
from the session's kept K/V (``usage.prompt_tokens_details.cached_tokens``), the tokens it prefilled, the call's
time, and how far its sampled tokens equal the run without the cache and their log-probs' largest difference there
(a later turn's input differs once a turn's tokens did).

    python benchmarks/session_prefill.py [--model .cache/models/SmolLM2-135M-Instruct] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import openai
from transformers import AutoTokenizer

from rlrun.agents.server import AgentServer
from rlrun.agents.sessions import Session
from rlrun.agents.template import ChatTemplate
from rlrun.agents.tool_parsers import TOOL_PARSERS
from rlrun.data.sample import Prompt
from rlrun.engine.embedded.engine import EmbeddedEngine

SYSTEM = (
    "You are a careful assistant with a calculator. To use it, reply with exactly "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> and wait for the result.'
)
QUESTION = "A shop sells 17 boxes of 24 pens and 9 boxes of 36 pens. How many pens is that, minus 50?"
TOOL_RESULTS = ["408", "324", "682"]
SAMPLING = {"max_new_tokens": 48, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1, "sampling_seed": 0}


class TimedEngine:
    """The engine behind the server, timing each call and counting what it prefilled."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine, self.turns = engine, []

    def generate(self, input_ids, sampling_params, return_logprob=True):
        before, start = self.engine.sessions.prefill_tokens, time.perf_counter()
        results = self.engine.generate(input_ids, sampling_params, return_logprob)
        self.turns.append(
            {
                "seconds": round(time.perf_counter() - start, 3),
                "prefilled": self.engine.sessions.prefill_tokens - before,
                "output_ids": results[0]["output_ids"],
                "output_logprobs": results[0]["output_logprobs"],
            }
        )
        return results


async def _conversation(engine: TimedEngine, tokenizer) -> list[dict]:
    server = AgentServer(engine, tokenizer, TOOL_PARSERS["hermes"], SAMPLING, 2048, "policy", concurrency=1)
    session = Session("bench", Prompt(0, [1], QUESTION), seed=0, template=ChatTemplate(tokenizer))
    server.sessions[session.id] = session
    await server.start()
    client = openai.AsyncOpenAI(base_url=server.base_url("bench"), api_key=server.token, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    usage = []
    try:
        for turn in range(4):
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=48)
            usage.append(reply.usage.model_dump())
            messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
            if turn < 3:
                messages.append({"role": "tool", "content": TOOL_RESULTS[turn], "tool_call_id": f"call_{turn}"})
    finally:
        await client.close()
        await server.stop()
    return usage


def measure(model: Path, session_cache_size: int) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = TimedEngine(EmbeddedEngine(model, seed=0, session_cache_size=session_cache_size))
    usage = asyncio.run(_conversation(engine, tokenizer))
    for turn, use in zip(engine.turns, usage, strict=True):
        turn["input_tokens"] = use["prompt_tokens"]
        turn["cached_tokens"] = (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return engine.turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".cache/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    without, with_cache = measure(args.model, 0), measure(args.model, 8)
    turns = []
    for k, (a, b) in enumerate(zip(without, with_cache, strict=True)):
        same = a["output_ids"] == b["output_ids"]
        pairs = zip(a["output_ids"], b["output_ids"], strict=False)
        common = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a["output_ids"]), len(b["output_ids"])))
        logprobs = zip(a["output_logprobs"][:common], b["output_logprobs"][:common], strict=True)
        gap = max((abs(x - y) for x, y in logprobs), default=0.0)
        turns.append(
            {
                "turn": k + 1,
                "input_tokens": a["input_tokens"],
                "prefilled_without": a["prefilled"],
                "prefilled_with": b["prefilled"],
                "cached_tokens": b["cached_tokens"],
                "seconds_without": a["seconds"],
                "seconds_with": b["seconds"],
                "same_tokens": same,
                "same_leading_tokens": common,
                "max_logprob_diff": gap,
            }
        )
        print(json.dumps(turns[-1]))
    if args.out:
        args.out.write_text(json.dumps({"model": str(args.model.name), "dtype": "float32", "turns": turns}, indent=2))


if __name__ == "__main__":
    main()
