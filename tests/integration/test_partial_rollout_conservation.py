"""Streaming rounds on 2 real ranks against a simulated engine with a long tail that only an abort ends:
partial rollout conserves every group (each drawn prompt's group trained exactly once or still carried,
a carried sample's tokens exactly what the engine had written at the abort, carried + continued tokens
exactly the uninterrupted response), whatever the threads' timing; aborting the surplus carries nothing.
The rollout-time numbers (a timed engine whose slowest group is 4x longer) come from
benchmarks/partial_rollout_timing.py, not from this test."""

from __future__ import annotations

import io
import json
import textwrap
import threading

import pytest

from dist_utils import run_distributed

pytestmark = pytest.mark.slow

FAST_TOKENS, SLOW_TOKENS = 20, 80
NUM_ROWS, NUM_STEPS = 80, 6
ROLLOUT = {"prompts_per_step": 4, "over_sampling_prompts": 12, "samples_per_prompt": 2, "max_new_tokens": 200}


def is_slow(row: int) -> bool:
    return row % 5 == 0


def response_of(row: int) -> list[int]:
    """The one response the simulated engine writes for row ``row``'s prompt."""
    return [10 + (row * 7 + k) % 200 for k in range(SLOW_TOKENS if is_slow(row) else FAST_TOKENS)]


class GatedEngine:
    """Fast rows finish at once. A slow row started from its prompt writes ``FAST_TOKENS`` tokens and then
    stalls until ``abort`` (the long tail of a real batch); continued rows finish at once. So every slow
    group a round starts is aborted holding exactly ``FAST_TOKENS`` tokens per sample, and a call that
    reaches the engine after an abort stalls until the next one (as a real engine's late request runs on)."""

    def __init__(self, rows: dict[tuple[int, ...], int]):
        self.rows, self.lock, self.inflight = rows, threading.Lock(), []
        self.prompt_lengths = sorted({len(p) for p in rows})

    def _row_of(self, ids: list[int]) -> tuple[int, int]:
        """(row, tokens already written) of an input: a prompt, or a prompt + its carried tokens."""
        for n in self.prompt_lengths:
            if tuple(ids[:n]) in self.rows:
                return self.rows[tuple(ids[:n])], len(ids) - n
        raise AssertionError(f"input {ids[:8]}... starts with no known prompt")

    def generate(self, input_ids, sampling_params, return_logprob=True, rids=None):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        flag = threading.Event()  # compared by identity when removed (equal events would not be)
        with self.lock:
            self.inflight.append(flag)
        out, stalls = [], False
        for ids, p in zip(input_ids, params, strict=True):
            row, written = self._row_of(ids)
            stall = is_slow(row) and written == 0
            tokens = response_of(row)[:FAST_TOKENS] if stall else response_of(row)[written:][: p["max_new_tokens"]]
            stalls |= stall
            reason = {"type": "abort", "message": "Aborted"} if stall else {"type": "stop", "matched": tokens[-1]}
            out += [{"output_ids": tokens, "output_logprobs": [-1.0] * len(tokens), "finish_reason": reason}] * p["n"]
        if stalls and not flag.wait(timeout=120):
            raise RuntimeError("a stalled call was never aborted")
        with self.lock:
            self.inflight.remove(flag)
        return [{**o, "weight_version": "0"} for o in out]

    def abort(self, rid="", abort_all=False):
        with self.lock:
            for flag in self.inflight:
                flag.set()


def collect_steps(model_dir, data, reward, scenarios):
    import torch
    from transformers import AutoTokenizer

    from minimal_config import run_config
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.rollout.collect import RolloutRuntime
    from rlrun.rollout.streaming import carry_from_state
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, 0)
    out = []
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for rollout in scenarios:
            cfg = run_config(
                {
                    "model": {"path": model_dir},
                    "data": {"path": data, "apply_chat_template": False, "shuffle": False},
                    "rollout": {**ROLLOUT, "reward": reward, **rollout},
                }
            )
            dataset = PromptDataset(cfg.data, tokenizer)
            sampler = PromptSampler(dataset, seed=0, shuffle=False) if parallel.is_rank0 else None
            engine = GatedEngine({tuple(p.prompt_ids): p.index for p in dataset.prompts})
            runtime = RolloutRuntime.build(cfg, parallel, engine, tokenizer, sampler)
            steps = []
            for step in range(NUM_STEPS):
                batch = runtime.collect(step)
                assert not engine.inflight  # every call returned: nothing left generating
                if batch is not None:
                    samples = [(s.group_index, s.response_ids, s.carried_tokens) for s in batch.samples]
                    steps.append((samples, batch.metrics))
            if not parallel.is_rank0:
                continue
            buffer = io.BytesIO()  # the checkpoint's round trip (rlrun/trainer/checkpoint.py)
            torch.save(runtime.carry_state(), buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
            assert state is None or carry_from_state(state) == runtime.carry
            carry = [g[0].group_index for g in runtime.carry]
            out.append((steps, carry, sampler.state_dict()["position"]))
        return out if parallel.is_rank0 else None
    finally:
        destroy_distributed()


def test_partial_rollout_conserves_every_group_and_abort_surplus_carries_none(tiny_model_dirs, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"row {i}:", "label": i}) + "\n" for i in range(NUM_ROWS)))
    hooks = tmp_path / "hooks.py"
    hooks.write_text(textwrap.dedent("def reward(sample):\n    return float(len(sample.response_ids))\n"))
    scenarios = [{"partial_rollout": True}, {"abort_surplus": True}]
    partial, abort_surplus = run_distributed(
        collect_steps, 2, str(tiny_model_dirs["qwen2"]), str(data), f"{hooks}:reward", scenarios
    )

    steps, carry, num_drawn = partial
    per_step = [[g for g, *_ in samples[::2]] for samples, _ in steps]
    trained = [g for groups in per_step for g in groups]
    assert [len(groups) for groups in per_step] == [4] * NUM_STEPS
    assert len(trained) == len(set(trained))  # no group trained twice
    assert set(trained) | set(carry) == set(range(num_drawn)) and not set(trained) & set(carry)  # none lost
    for samples, _ in steps:
        for group, response, _ in samples:
            assert response == response_of(group)  # carried tokens + continuation == the whole response
    carried = [(group, ct) for samples, _ in steps for group, _, ct in samples if ct]
    assert carried and all(is_slow(g) and ct == FAST_TOKENS for g, ct in carried)  # what the engine had written
    metrics = [m for _, m in steps]
    assert [m["rollout/tokens_saved"] for m in metrics] == [sum(ct for *_, ct in s) for s, _ in steps]
    # Step 0 kept 9 fast groups of 12: step 1's batch comes from the carry alone, without a round; its
    # aborted groups stay carried (this is where slow groups were lost).
    assert metrics[1]["rollout/sampling_rounds"] == 0 and metrics[1]["rollout/carried_partial_samples"] > 0

    steps, carry, _ = abort_surplus
    assert carry == [] and all(m["rollout/aborted_groups"] >= 1 for _, m in steps)
    assert all(ct == 0 for samples, _ in steps for *_, ct in samples)
