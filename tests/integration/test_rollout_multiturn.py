"""The calculator-tool agent against a real embedded engine (a worker process with a tiny model):
the loss mask covers exactly the tokens the engine generated, environment tokens are exactly the
tool / nudge turns, and the engine's log-probs of the model's tokens match Hugging Face's forward
over the whole multi-turn sequence (so the mask is aligned with the trainer's view)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from minimal_config import rollout_config
from rlrun.config.schema import DataConfig
from rlrun.data.prompts import PromptDataset
from rlrun.rollout.driver import sampling_params
from rlrun.rollout.multiturn import load_generate_fn, run_generate_fn

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "examples/calculator_tool/agent.py"
SYSTEM = "Use <calc>expression</calc> for arithmetic. Reply with the final number."


class RecordingEngine:
    """The real engine client, with every generate call's inputs and outputs kept for checking."""

    def __init__(self, engine):
        self.engine = engine
        self.calls: list[tuple[list[int], dict]] = []

    def generate(self, input_ids, sampling_params, return_logprob=True):
        results = self.engine.generate(input_ids, sampling_params, return_logprob=return_logprob)
        self.calls.append((input_ids, results))
        return results


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values as (value, start, end)."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_loss_mask_covers_exactly_the_models_tokens(tiny_model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlrun.engine.client import EngineClient
    from rlrun.engine.registry import BackendSpec

    model_dir = tiny_model_dirs["qwen2"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = tmp_path / "q.jsonl"  # short prompts: the byte-level test tokenizer leaves room for 4 turns
    rows.write_text("".join(f'{{"prompt": "What is {a} * 7 + 1?", "label": {a * 7 + 1}}}\n' for a in (12, 34, 56)))
    data = DataConfig(path=str(rows), system_prompt=SYSTEM)
    prompts = PromptDataset(data, tokenizer).prompts
    cfg = rollout_config(samples_per_prompt=4, max_new_tokens=6, generate_fn=f"{AGENT}:generate")
    with EngineClient.spawn(BackendSpec("embedded", str(model_dir), 0), run_dir=tmp_path, rank=0) as engine:
        recorder = RecordingEngine(engine)
        samples = run_generate_fn(
            load_generate_fn(cfg.generate_fn),
            recorder,
            prompts,
            4,
            sampling_params(cfg, 11),
            11,
            tokenizer,
            max_context_tokens=512,
        )
        # A tight context: every trajectory stops at the limit (a turn gets only the room left).
        limit = max(len(p.prompt_ids) for p in prompts) + 9
        tight = run_generate_fn(
            load_generate_fn(cfg.generate_fn),
            engine,
            prompts,
            2,
            sampling_params(cfg, 5),
            5,
            tokenizer,
            max_context_tokens=limit,
        )
    for sample in tight:
        assert sample.total_length <= limit and len(sample.loss_mask) == len(sample.response_ids)
    assert any(s.total_length == limit and s.finish_reason == "length" for s in tight)

    spec = importlib.util.spec_from_file_location("calc_agent", AGENT)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    generated: dict[tuple, list[dict]] = {}  # full input -> the outputs the engine gave for it
    for inputs, results in recorder.calls:
        for ids, result in zip(inputs, results, strict=False):
            generated.setdefault(tuple(ids), []).append(result)
    assert len(recorder.calls) < sum(
        1 for s in samples for value, _, _ in runs(s.loss_mask) if value == 1
    )  # batched turns

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_env_runs = 0
    for sample in samples:
        assert len(sample.loss_mask) == len(sample.response_ids) == len(sample.rollout_logprobs)
        prompt_ids = sample.prompt.prompt_ids
        segments = runs(sample.loss_mask)
        assert segments[0][0] == 1 and segments[-1][0] == 1  # starts and ends with a model turn
        for value, start, end in segments:
            context = tuple(prompt_ids + sample.response_ids[:start])
            if value == 1:
                # A model segment is exactly one engine output for exactly this context, used once.
                outputs = generated[context]
                match = next(r for r in outputs if r["output_ids"] == sample.response_ids[start:end])
                assert sample.rollout_logprobs[start:end] == match["output_logprobs"]
                outputs.remove(match)
            else:
                num_env_runs += 1
                assert context not in generated  # nobody asked the engine to generate here
                text = tokenizer.decode(sample.response_ids[start:end], skip_special_tokens=False)
                turn = tokenizer.decode(
                    sample.response_ids[segments[[s[1] for s in segments].index(start) - 1][1] : start],
                    skip_special_tokens=True,
                )
                role, reply = agent.environment_reply(turn)
                assert text.endswith(f"\n<|im_start|>{role}\n{reply}<|im_end|>\n<|im_start|>assistant\n")
                assert all(lp == 0.0 for lp in sample.rollout_logprobs[start:end])
        # Independent reference: HF's log-probs over the whole sequence at the model's own positions.
        tokens = torch.tensor([prompt_ids + sample.response_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(tokens).logits[0, :-1].float() / cfg.temperature, dim=-1)
        targets = tokens[0, 1:]
        ref = logprobs.gather(-1, targets[:, None])[:, 0][len(prompt_ids) - 1 :]
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        assert torch.allclose(ref[mask], torch.tensor(sample.rollout_logprobs)[mask], atol=1e-4)
    assert num_env_runs > 0, "no environment turn in any trajectory: the test would prove nothing"
    assert not any(generated.values())  # every engine output ended up in exactly one sample
