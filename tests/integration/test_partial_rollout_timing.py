"""Streaming rounds on 2 real ranks against a simulated engine whose cost is real time: every fifth group
needs 4x the tokens of the others. Waiting for every group (the default rounds), aborting the surplus and
partial rollout are timed over the same steps; partial rollout also conserves every group (trained exactly
once, its carried tokens and their continuation exactly the uninterrupted response)."""

from __future__ import annotations

import json
import textwrap
import threading
import time

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.slow

TOKEN_S = 0.01
FAST_TOKENS, SLOW_TOKENS = 20, 80  # the slowest group is 4x longer
NUM_ROWS, NUM_STEPS = 40, 6


def response_of(first_token: int) -> list[int]:
    """The one response the simulated engine writes for a prompt (token k is a function of k)."""
    length = SLOW_TOKENS if first_token % 5 == 0 else FAST_TOKENS
    return [10 + (first_token * 7 + k) % 200 for k in range(length)]


class TimedEngine:
    """Each call generates one token per ``TOKEN_S`` per sample, all calls in parallel (a batching engine);
    ``abort`` ends the calls in flight with what they have. Continuations pick up where the input ends."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.lock, self.inflight, self.num_calls = prompt_len, threading.Lock(), [], 0

    def generate(self, input_ids, sampling_params, return_logprob=True, rids=None):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        flag = threading.Event()  # compared by identity when removed (equal dicts would not be)
        with self.lock:
            self.inflight.append(flag)
            self.num_calls += 1
        rows = [(ids, p) for ids, p in zip(input_ids, params, strict=True) for _ in range(p["n"])]
        todo = [response_of(ids[0])[len(ids) - self.prompt_len :][: p["max_new_tokens"]] for ids, p in rows]
        made = 0
        while made < max(len(t) for t in todo) and not flag.is_set():
            time.sleep(TOKEN_S)
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


def timed_collect(model_dir, data, reward, scenarios):
    from transformers import AutoTokenizer

    from rlrun.config.schema import RunConfig
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.rollout.collect import RolloutRuntime
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, 0)
    out = []
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for rollout in scenarios:
            cfg = RunConfig.model_validate(
                {
                    "model": {"path": model_dir},
                    "data": {"path": data, "apply_chat_template": False, "shuffle": False},
                    "rollout": {"samples_per_prompt": 2, "max_new_tokens": 200, "reward": reward, **rollout},
                }
            )
            dataset = PromptDataset(cfg.data, tokenizer)
            sampler = PromptSampler(dataset, seed=0, shuffle=False) if parallel.is_rank0 else None
            engine = TimedEngine(prompt_len=len(dataset.prompts[0].prompt_ids))
            runtime = RolloutRuntime.build(cfg, parallel, engine, tokenizer, sampler)
            steps = []
            for step in range(NUM_STEPS):
                start = time.perf_counter()
                batch = runtime.collect(step)
                seconds = time.perf_counter() - start
                if batch is not None:
                    samples = [
                        (s.group_index, s.prompt.prompt_ids[0], s.response_ids, s.carried_tokens) for s in batch.samples
                    ]
                    steps.append((seconds, samples, batch.metrics))
            carry = [s.group_index for g in runtime.carry for s in g][::2] if parallel.is_rank0 else None
            out.append((steps, carry, sampler.state_dict() if sampler else None))
        return out if parallel.is_rank0 else None
    finally:
        destroy_distributed()


@pytest.mark.xfail(
    reason="known defect: partial rollout loses drawn groups (11, 16, 21: slow groups, neither trained nor carried), "
    "on a fresh clone of main and alone, and at the rollout branch's own last commit e6efe42; it passed in its "
    "author's runs before the last rebase. Open until conservation holds again.",
    strict=False,
)
def test_partial_rollout_shortens_the_rollout_and_conserves_groups(tiny_model_dirs, tmp_path):
    data = tmp_path / "p.jsonl"
    # One character per prompt, so the first prompt token names the prompt; every fifth row is slow.
    letters = [chr(ord("a") + i % 26) for i in range(NUM_ROWS)]
    data.write_text("".join(json.dumps({"prompt": letters[i] * 3, "label": i}) + "\n" for i in range(NUM_ROWS)))
    hooks = tmp_path / "hooks.py"
    hooks.write_text(textwrap.dedent("def reward(sample):\n    return float(len(sample.response_ids))\n"))
    base = {"prompts_per_step": 4, "over_sampling_prompts": 8}
    scenarios = [base, {**base, "abort_surplus": True}, {**base, "partial_rollout": True}]
    wait_all, abort_surplus, partial = run_distributed(
        timed_collect, 2, str(tiny_model_dirs["qwen2"]), str(data), f"{hooks}:reward", scenarios
    )
    seconds = [sum(t for t, _, _ in steps) for steps, _, _ in (wait_all, abort_surplus, partial)]
    print(
        f"rollout seconds over {NUM_STEPS} steps: wait for all {seconds[0]:.2f}, abort surplus "
        f"{seconds[1]:.2f}, partial rollout {seconds[2]:.2f}"
    )
    assert seconds[2] < 0.6 * seconds[0] and seconds[1] < 0.6 * seconds[0]

    steps, carry, sampler_state = partial
    trained = [g for _, samples, _ in steps for g, *_ in samples[::2]]
    assert len(trained) == len(set(trained)) == 4 * NUM_STEPS  # every group trained once, whole batches
    drawn = set(range(sampler_state["position"]))
    assert set(trained) | set(carry) == drawn and not set(trained) & set(carry)  # nothing dropped
    carried = [(first, response, ct) for _, samples, _ in steps for _, first, response, ct in samples if ct]
    assert carried, "no sample was carried: the test would prove nothing"
    for _, samples, _ in steps:
        for _, first, response, _ in samples:
            assert response == response_of(first)  # carried tokens + continuation == the whole response
    metrics = [m for _, _, m in steps]
    assert sum(m["rollout/tokens_saved"] for m in metrics) == sum(ct for _, _, ct in carried)
    assert max(m["rollout/abort_wait_s"] for m in metrics) < 0.5

    steps, carry, _ = abort_surplus
    assert carry == [] and all(m["rollout/aborted_groups"] >= 1 for _, _, m in steps)
