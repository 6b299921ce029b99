"""What can be checked of benchmarks/verl_grpo.py without a GPU, under a Python that has verl 0.9.1 (its deps,
transformers 5.12.1 as on the device, no sglang). Each check prints one line and asserts; the session notes
(scripts/gpu/verl_session.md, "Checked on CPU") say what they cover and what only the GPU can show.

    python3 -m venv /tmp/verlvenv
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/verlvenv/lib/python3.11/site-packages/zz.pth
    /tmp/verlvenv/bin/pip install --no-deps .whl-verl/verl-0.9.1-py3-none-any.whl transformers==5.12.1 \\
        tokenizers==0.22.2 transferqueue==0.1.11 msgspec && /tmp/verlvenv/bin/pip install ray hydra-core \\
        "tensordict<=0.10.0" torchdata peft datasets pandas cachetools aiohttp uvicorn fastapi prometheus_client \\
        codetiming pylatexenc
    PYTHONPATH=$PWD:$PWD/benchmarks /tmp/verlvenv/bin/python scripts/gpu/verl_cpu_check.py

1. verl's Hydra config with the benchmark's overrides composes and validates, offload on and off.
2. verl's HFModelConfig and agent-loop prompt builder give the prompt's 128 word ids (rlrun's and TRL's).
3. The packed attention matches each sample's own eager forward on a tiny Qwen3 (the CUDA kernel swapped for
   per-sample SDPA), and refuses a padded batch.
4. The SGLang ignore_eos pass-through: the import hook patches a module right after it executes; the patched
   generate defaults ignore_eos to the config's.
5. verl's log-prob entry point reaches the replacement of its per-token loop and gives the label's log-softmax.
6. The sync trainer's replay buffer polls at ``VERL_BENCH_REPLAY_POLL_S`` when it is set, at verl's 2 s when not.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

import verl_grpo  # noqa: E402
import verl_plugins  # noqa: E402

from rlrun.tools.bench.shapes import get_shape  # noqa: E402
from rlrun.tools.bench.step import StepSettings, prompt_rows, write_word_tokenizer  # noqa: E402


def check_config() -> None:
    settings = StepSettings()
    for offload in (True, False):
        values = verl_grpo.overrides(settings, Path("/x/inputs"), Path("/x/p.parquet"), Path("/x/verl"), offload)
        summary = verl_grpo.check_config(verl_grpo.hydra_args(values))
        assert summary["actor_offload"] == [offload, offload] and summary["rollout"][4] == offload
        assert not summary["reference_model"] and summary["old_log_probs_from_rollout"]
    print("1. config composes and validates:", json.dumps(summary))


def check_prompt_ids(work: Path) -> None:
    from omegaconf import OmegaConf
    from transformers import Qwen3Config
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
    from verl.workers.config import HFModelConfig

    settings, spec = StepSettings(), get_shape("qwen3-0.6b")
    inputs, model = work / "inputs", work / "inputs" / "model"
    model.mkdir(parents=True)
    write_word_tokenizer(model, spec.vocab)
    Qwen3Config(
        vocab_size=spec.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=1, bos_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(model)  # fmt: skip
    rows = prompt_rows(settings, spec.vocab)
    (inputs / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "verl").mkdir()
    parquet = verl_grpo.write_dataset(inputs, work / "verl")
    config = HFModelConfig(
        path=str(model),
        custom_chat_template=verl_grpo.CHAT_TEMPLATE,
        external_lib="verl_plugins",
        override_config={"attn_implementation": verl_plugins.ATTENTION},
    )
    assert config.hf_config._attn_implementation == verl_plugins.ATTENTION
    builder = create_continuous_token_builder(config.tokenizer, hf_model_type=config.hf_config.model_type)
    data_config = {"max_prompt_length": 128, "filter_overlong_prompts": False, "truncation": "error"}
    dataset = RLHFDataset(data_files=str(parquet), tokenizer=config.tokenizer, config=OmegaConf.create(data_config))
    ids = builder.build_initial_tokens(list(dataset[0]["raw_prompt"]))
    assert ids == [int(word[1:]) for word in rows[0]["prompt"].split()] and len(ids) == settings.prompt_len
    print(f"2. prompt ids: {len(ids)}, the words' ids, through {type(builder).__name__}")


def check_attention() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def per_sample(q, k, v, bounds, max_len, dropout, scale):
        spans = zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        return torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
                ).transpose(0, 1)
                for a, b in spans
            ]
        )

    kernel, verl_plugins.causal_varlen = verl_plugins.causal_varlen, per_sample
    try:
        torch.manual_seed(0)
        shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        shape |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        packed = Qwen3ForCausalLM(Qwen3Config(**shape, attn_implementation=verl_plugins.ATTENTION)).eval()
        eager = Qwen3ForCausalLM(Qwen3Config(**shape, attn_implementation="eager")).eval()
        eager.load_state_dict(packed.state_dict())
        samples = [torch.randint(0, 64, (n,)) for n in (5, 9, 3)]
        positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
        with torch.no_grad():
            got = packed(input_ids=torch.cat(samples)[None], position_ids=positions, attention_mask=None).logits[0]
            want = torch.cat([eager(input_ids=s[None]).logits[0] for s in samples])
            gap = (got - want).abs().max().item()
            assert gap < 1e-4, gap
            try:
                packed(input_ids=torch.randint(0, 64, (2, 4)), attention_mask=torch.ones(2, 4, dtype=torch.long))
                raise AssertionError("a padded batch was accepted")
            except ValueError:
                pass
    finally:
        verl_plugins.causal_varlen = kernel
    print(f"3. packed attention: max |packed - per-sample eager| {gap:.1e}; padded batch refused")


def check_ignore_eos() -> None:
    patched = []
    verl_plugins.AFTER_IMPORT["wave"] = lambda module: patched.append(hasattr(module, "open"))
    try:
        assert "wave" not in sys.modules
        import wave  # noqa: F401  any module not imported yet: the finder must patch it after it executes
    finally:
        del verl_plugins.AFTER_IMPORT["wave"]
    assert patched == [True], patched
    patch = verl_plugins.AFTER_IMPORT[verl_plugins.SGLANG_SERVER]

    class SGLangHttpServer:  # the method's shape in verl 0.9.1
        def __init__(self, ignore_eos):
            self.config = {"ignore_eos": ignore_eos}

        async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
            return sampling_params

    patch(types.SimpleNamespace(SGLangHttpServer=SGLangHttpServer))
    assert asyncio.run(SGLangHttpServer(True).generate([1], {"temperature": 1.0}, "r"))["ignore_eos"] is True
    assert asyncio.run(SGLangHttpServer(True).generate([1], {"ignore_eos": False}, "r"))["ignore_eos"] is False
    print("4. ignore_eos: the hook patches on import; generate defaults it to rollout.ignore_eos")


def check_logprobs() -> None:
    """verl's own entry point (the one its FSDP engine calls) reaches the replacement, not the per-token loop,
    and gives each label's log-softmax."""
    from verl.utils import torch_functional

    assert not torch_functional.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE, "flash-attn is installed: nothing to replace"
    assert torch_functional.logprobs_from_logits_v2 is verl_plugins.logprobs_of_labels
    logits = torch.randn(640, 1000, dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (640,))
    got = torch_functional.logprobs_from_logits(logits, labels)
    want = logits.double().log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    gap = (got.double() - want).abs().max().item()
    assert got.dtype == torch.float32 and gap < 1e-5, gap
    print(f"5. log-probs: verl's logprobs_from_logits runs the replacement; max |gap| to float64 {gap:.1e}")


def check_replay_poll() -> None:
    """The sync trainer's replay buffer polls at the benchmark's interval, and verl's wait sleeps on it."""
    import inspect
    import os

    from verl.trainer.ppo.v1 import replay_buffer

    def built():
        return replay_buffer.ReplayBuffer("sync", {}, None, "drop", {}, train_batch_size=16, gen_batch_size=16)

    assert "time.sleep(self.poll_interval)" in inspect.getsource(replay_buffer.ReplayBuffer._wait_for_next_poll)
    default = built().poll_interval
    os.environ[verl_plugins.REPLAY_POLL_ENV] = "0.05"
    try:
        polled = built().poll_interval
    finally:
        del os.environ[verl_plugins.REPLAY_POLL_ENV]
    assert (default, polled) == (2.0, 0.05), (default, polled)
    print(f"6. replay buffer: polls every {default} s by default, {polled} s with {verl_plugins.REPLAY_POLL_ENV}")


if __name__ == "__main__":
    check_config()
    with tempfile.TemporaryDirectory() as work:
        check_prompt_ids(Path(work))
    check_attention()
    check_ignore_eos()
    check_logprobs()
    check_replay_poll()
