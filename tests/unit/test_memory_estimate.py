"""``rlrun doctor``'s trainer-memory estimate (rlrun/memory_estimate.py) against peaks measured on the H200, and
what each memory option moves; the optimizer-offload config Megatron is given, and where it is refused."""

from __future__ import annotations

import pytest

from rlrun.bench.shapes import SHAPES
from rlrun.config.schema import RunConfig
from rlrun.doctor import config_checks
from rlrun.memory_estimate import estimate

MEASURED_H200 = [("qwen3-0.6b", 32768, 84.3), ("qwen3-1.7b", 16384, 83.7), ("qwen3-4b", 8192, 117.7)]
"""Issue 23's table: ``rlrun bench train --layout packed --samples-per-micro-batch 1``, bf16, Megatron's output
layer, no recompute (2026-12-01): torch.cuda.max_memory_allocated in GiB."""


def arch_of(shape_name: str):
    from transformers import Qwen3Config

    from rlrun.megatron.hf_config import ModelArch

    s = SHAPES[shape_name]
    config = Qwen3Config(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied,
    )
    return ModelArch.from_dict(config.to_dict())


def config(tokens: int, **sections) -> RunConfig:
    model = {"dtype": "bfloat16", **sections.pop("model", {})}
    train = {"max_tokens_per_micro_batch": tokens, **sections.pop("train", {})}
    return RunConfig.model_validate({"model": model, "train": train, **sections})


@pytest.mark.parametrize("shape, tokens, peak_gib", MEASURED_H200)
def test_estimate_matches_measured_peaks(shape, tokens, peak_gib):
    got = estimate(config(tokens, model={"lm_head": "logits"}), arch_of(shape), dp=1).total_gib
    assert got == pytest.approx(peak_gib, rel=0.03)


def test_each_option_lowers_what_it_should():
    arch = arch_of("qwen3-4b")
    base = estimate(config(32768, model={"lm_head": "logits"}), arch, 1)
    chunked = estimate(config(32768), arch, 1)
    # two 1 GiB fp32 chunks and the weight gradient's fp32 sum + bf16 result instead of the logits
    assert (
        chunked.lm_head_gib == pytest.approx(2.0 + 151936 * 2560 * 6 / 2**30) and chunked.lm_head_gib < base.lm_head_gib
    )
    per_token = [
        estimate(config(32768, train={"recompute": r}), arch, 1).activation_bytes_per_token
        for r in ("none", "selective", "full")
    ]
    assert per_token[0] > per_token[1] > per_token[2] == 36 * 2560 * 2  # full keeps each layer's input (bf16)
    half = estimate(config(32768, train={"recompute": "full", "recompute_num_layers": 18}), arch, 1)
    full = estimate(config(32768, train={"recompute": "full"}), arch, 1)
    assert full.activations_gib < half.activations_gib < chunked.activations_gib
    offload = {"use_distributed_optimizer": True, "cpu_offload": True}
    moved = estimate(config(8192, optimizer=offload), arch, 1)
    assert moved.optimizer_gib == pytest.approx(chunked.optimizer_gib / 3)  # fp32 main weights stay on the device
    assert moved.host_optimizer_gib == pytest.approx(chunked.optimizer_gib * 16 / 12)
    sharded = estimate(config(8192, optimizer={"use_distributed_optimizer": True}), arch, 4)
    assert sharded.optimizer_gib == pytest.approx(chunked.optimizer_gib / 4)


def test_doctor_reports_the_estimate(tiny_model_dirs):
    cfg = RunConfig.model_validate({"model": {"path": str(tiny_model_dirs["llama"])}, "train": {"recompute": "full"}})
    check = {c.name: c for c in config_checks(cfg, num_gpus=0)}["memory: trainer"]
    assert check.status == "info" and "train.recompute full" in check.detail and "GiB per rank" in check.detail


def test_offload_config_is_what_megatron_accepts_and_refused_where_it_cannot_work():
    from rlrun.megatron.train import optimizer_config

    adam = dict(lr=1e-6, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0)
    megatron = optimizer_config("bfloat16", True, "cuda", cpu_offload=True, offload_fraction=0.5, **adam)
    assert megatron.optimizer_cpu_offload and megatron.overlap_cpu_optimizer_d2h_h2d
    assert megatron.optimizer_offload_fraction == 0.5 and megatron.decoupled_weight_decay  # Megatron asserts it
    for dtype, distributed, device, reason in [
        ("bfloat16", True, "cpu", "run on CUDA"),
        ("bfloat16", False, "cuda", "use_distributed_optimizer"),
        ("float32", True, "cuda", "model.dtype bfloat16"),
    ]:
        with pytest.raises(ValueError, match=reason):
            optimizer_config(dtype, distributed, device, cpu_offload=True, **adam)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        RunConfig.model_validate({"optimizer": {"cpu_offload": True}})


def test_context_parallel_scope_and_share():
    with pytest.raises(ValueError, match="parallel.cp"):
        RunConfig.model_validate({"parallel": {"cp": 2, "pp": 2}})
    with pytest.raises(ValueError, match="critic's values are not gathered"):
        RunConfig.model_validate(
            {"parallel": {"cp": 2}, "algorithm": {"advantage_estimator": "ppo"}, "critic": {"config": "x.yaml"}}
        )
    arch = arch_of("qwen3-4b")
    one = estimate(config(32768, train={"recompute": "full"}), arch, 1)
    two = estimate(config(32768, train={"recompute": "full"}, parallel={"cp": 2}), arch, 1)
    assert two.activations_gib == pytest.approx(one.activations_gib / 2)
