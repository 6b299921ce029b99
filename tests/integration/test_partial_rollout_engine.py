"""Partial rollout on 2 real ranks with real embedded engines: every drawn group is trained exactly once
(or still carried at the end), a carried sample's tokens are exactly what the engine returned at the abort,
its continuation is conditioned on prompt + those tokens (its log-probs equal an HF forward over the whole
sequence), older-weight tokens are masked, and the abort leaves the engine idle at once.

Every fourth row is a deterministic long tail: the engine worker (tests/fakes/backends/held_backend.py, the
embedded engine with a hold) generates ``HELD_TOKENS`` real tokens for it and holds the call until the abort,
so each round has a group still generating when the batch fills however loaded the machine is; the held group's
continuation then comes back before any other call of either rank starts, so it trains in the next step."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.slow

NUM_ROWS, NUM_STEPS, SEED = 64, 2, 5
"""Step 0 draws rows 0-3: row 3 is held and aborted, and the other three leave at most one finished group
beyond the batch, so step 1 starts a round, where row 3's continuation returns first and trains."""
HELD_TOKENS = 6


def is_held(row: int) -> bool:
    """At most one held row among any 4 consecutive draws: each round's other groups fill the batch."""
    return row % 4 == 3


ROLLOUT = {
    "prompts_per_step": 2,
    "over_sampling_prompts": 4,
    "samples_per_prompt": 2,
    "max_new_tokens": 300,
    "stop_token_ids": list(range(0, 4)),  # long-tailed random lengths: groups finish at different times
    "partial_rollout": True,
    "partial_rollout_mask_offpolicy": True,
}


def collect_steps(model_dir: str, run_dir: str, data: str, reward: str):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine_contract import FAKES_DIR
    from minimal_config import run_config
    from rlrun.data.prompts import PromptDataset, PromptSampler
    from rlrun.engine.client import EngineClient
    from rlrun.engine.registry import BackendSpec
    from rlrun.rollout.collect import RolloutRuntime
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    parallel = init_distributed(1, 1, SEED)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        weights = [(n, t.detach()) for n, t in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()]
        cfg = run_config(
            {
                "model": {"path": model_dir},
                "data": {"path": data, "shuffle": False},
                "rollout": {**ROLLOUT, "reward": reward},
            }
        )
        dataset = PromptDataset(cfg.data, tokenizer)
        sampler = PromptSampler(dataset, seed=SEED, shuffle=False) if parallel.is_rank0 else None
        steps = []
        held = {
            "held_prompts": [p.prompt_ids for p in dataset.prompts if is_held(p.index)],
            "held_tokens": HELD_TOKENS,
            "gate_dir": str(Path(run_dir) / "held_gate"),
        }
        spec = BackendSpec("held", model_dir, parallel.rank, factory="held_backend:build", server_args=held)
        pythonpath = os.pathsep.join(p for p in (str(FAKES_DIR / "backends"), os.environ.get("PYTHONPATH")) if p)
        with EngineClient.spawn(
            spec, run_dir=Path(run_dir), rank=parallel.rank, extra_env={"PYTHONPATH": pythonpath}
        ) as engine:
            runtime = RolloutRuntime.build(cfg, parallel, engine, tokenizer, sampler)
            for step in range(NUM_STEPS):
                batch = runtime.collect(step)
                assert engine.health()["num_inflight"] == 0  # the abort left nothing generating
                # The same weights under a new version: carried tokens become "older weights" for the mask.
                engine.update_weights(weights, weight_version=str(step + 1), bucket_bytes=1 << 22)
                if batch is not None:
                    carry = [[_row(s, k) for k, s in enumerate(g)] for g in runtime.carry]
                    steps.append(([_row(s, k) for k, s in enumerate(batch.samples)], carry, batch.metrics))
        dist.barrier(group=parallel.cpu_group)
        return (steps, sampler.state_dict()) if parallel.is_rank0 else None
    finally:
        destroy_distributed()


def _row(s, k):
    return {
        "group": s.group_index,
        "slot": k % ROLLOUT["samples_per_prompt"],
        "prompt_ids": s.prompt.prompt_ids,
        "response_ids": s.response_ids,
        "logprobs": s.rollout_logprobs,
        "finish": s.finish_reason,
        "carried_tokens": s.carried_tokens,
        "spans": s.weight_spans,
        "loss_mask": s.loss_mask,
        "version": s.weight_version,
    }


def test_partial_rollout_conserves_samples(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}", "label": i}) + "\n" for i in range(NUM_ROWS)))
    (tmp_path / "hooks.py").write_text(textwrap.dedent("def reward(s):\n    return float(len(s.response_ids))\n"))
    model_dir = str(tiny_model_dirs["qwen2"])
    steps, sampler_state = run_distributed(
        collect_steps, 2, model_dir, str(tmp_path / "run"), str(data), f"{tmp_path}/hooks.py:reward"
    )
    trained = [r["group"] for samples, _, _ in steps for r in samples if r["slot"] == 0]
    final_carry = [g[0]["group"] for g in steps[-1][1]]
    assert len(trained) == len(set(trained)) == ROLLOUT["prompts_per_step"] * NUM_STEPS
    assert set(trained).isdisjoint(final_carry)
    assert sampler_state["epoch"] == 0  # one pass over the rows: group indices are the draw order
    assert set(trained) | set(final_carry) == set(range(sampler_state["position"]))  # nothing lost
    assert all(r["finish"] != "abort" for samples, _, _ in steps for r in samples)

    batches = {(r["group"], r["slot"]): r for samples, _, _ in steps for r in samples}
    continued = set()
    for _, carry, _ in steps:
        for group in carry:
            for row in group:
                later = batches.get((row["group"], row["slot"]))
                if later is None or row["finish"] != "abort":
                    continue
                n = len(row["response_ids"])
                assert later["response_ids"][:n] == row["response_ids"]  # the carried tokens, unchanged
                assert later["logprobs"][:n] == row["logprobs"]
                assert later["carried_tokens"] >= n
                continued.add((row["group"], row["slot"]))
    held_trained = {(g, k) for g in trained if is_held(g) for k in range(ROLLOUT["samples_per_prompt"])}
    assert {g for g, _ in held_trained} == {3}  # row 3 was drawn in step 0, aborted, carried and trained in step 1
    assert held_trained <= continued  # every trained held sample went through an abort and a continuation
    assert all(batches[key]["carried_tokens"] >= HELD_TOKENS for key in held_trained)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    masked = 0
    for row in batches.values():
        if not row["carried_tokens"]:
            continue
        tokens = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(tokens).logits[0, :-1].float(), dim=-1)
        ref = logprobs.gather(-1, tokens[0, 1:, None])[:, 0][len(row["prompt_ids"]) - 1 :]
        torch.testing.assert_close(torch.tensor(row["logprobs"]), ref, atol=1e-4, rtol=0)
        old = sum(n for version, n in row["spans"] if version != row["version"])
        assert row["loss_mask"][:old] == [0] * old and all(row["loss_mask"][old:])
        masked += old
    metrics = [m for _, _, m in steps]
    assert sum(m["rollout/offpolicy_masked_tokens"] for m in metrics) == masked > 0
    assert sum(m["rollout/tokens_saved"] for m in metrics) == sum(r["carried_tokens"] for r in batches.values())
    assert max(m["rollout/staleness_max"] for m in metrics) >= 1
    assert max(m["rollout/abort_wait_s"] for m in metrics) < 2.0
