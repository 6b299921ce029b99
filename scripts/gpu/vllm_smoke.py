"""vLLM smoke check on the GPU machine: ``vllm.LLM`` as TRL's colocate mode builds it (in-process
``external_launcher``, sleep mode, processed log-probs), on the tiny random model of ``rlrun bench step``,
eager (no compile, no CUDA graphs: seconds, not minutes). Generates fixed-length responses from token ids,
sleeps at level 2 and wakes up as TRL does each step, and prints one JSON line.

    bash scripts/gpu/vllm_stage.sh smoke     # after install, with vLLM's Python
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.trl_grpo import VLLM_ENV  # noqa: E402
from rlrun.tools.bench.step import StepSettings, prepare_inputs  # noqa: E402

NEW_TOKENS = 16


def main() -> None:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    os.environ.update(VLLM_ENV)  # as the benchmark runs it
    settings = StepSettings(shape="tiny", prompts=4, prompt_len=8, new_tokens=NEW_TOKENS)
    inputs = prepare_inputs(settings, Path("/tmp/vllm_smoke"), "bfloat16", "cuda")
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(
        model=str(inputs / "model"),
        gpu_memory_utilization=0.1,
        max_model_len=settings.prompt_len + NEW_TOKENS,
        max_num_seqs=settings.prompts,
        enable_sleep_mode=True,
        distributed_executor_backend="external_launcher",
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        max_num_batched_tokens=4096,
        seed=0,
    )
    started = time.perf_counter()
    rows = [json.loads(line) for line in (inputs / "prompts.jsonl").read_text().splitlines()]
    tokenizer = llm.get_tokenizer()  # the word-level tokenizer: one id a word, as TRL feeds them
    prompts = [{"prompt_token_ids": tokenizer(row["prompt"])["input_ids"]} for row in rows]
    params = SamplingParams(temperature=1.0, top_k=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    print(
        json.dumps(
            {
                "vllm_smoke": "ok" if lengths == [NEW_TOKENS] * len(prompts) else "wrong lengths",
                "prompt_lengths": [len(p["prompt_token_ids"]) for p in prompts],
                "response_lengths": lengths,
                "import_s": round(imported - start, 1),
                "engine_start_s": round(started - imported, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
