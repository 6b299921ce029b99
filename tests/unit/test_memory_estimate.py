"""``rlrun doctor``'s trainer-memory estimate (rlrun/tools/memory_estimate.py) against peaks measured on the H200, and
what each memory option moves; the optimizer-offload config Megatron is given, and where it is refused."""

from __future__ import annotations

import pytest

from minimal_config import run_config
from rlrun.config.schema import RunConfig
from rlrun.tools.bench.shapes import SHAPES
from rlrun.tools.doctor import config_checks
from rlrun.tools.memory_estimate import estimate, rank_params

MEASURED_H200 = [("qwen3-0.6b", 32768, 84.3), ("qwen3-1.7b", 16384, 83.7), ("qwen3-4b", 8192, 117.7)]
"""H200 peaks of ``rlrun bench train --layout packed --samples-per-micro-batch 1``, bf16, Megatron's output
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
    return run_config({"model": model, "train": train, **sections})


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
    kept = estimate(config(32768, model={"lm_head": "chunked_kept"}), arch, 1)  # + the forward's bf16 logits
    assert kept.lm_head_gib == pytest.approx(chunked.lm_head_gib + 32768 * 151936 * 2 / 2**30)
    assert kept.lm_head_gib < base.lm_head_gib
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
    cfg = run_config({"model": {"path": str(tiny_model_dirs["llama"])}, "train": {"recompute": "full"}})
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
        run_config({"optimizer": {"cpu_offload": True}})


def test_context_parallel_scope_and_share():
    with pytest.raises(ValueError, match="parallel.cp"):
        run_config({"parallel": {"cp": 2, "pp": 2}})
    with pytest.raises(ValueError, match="critic's values are not gathered"):
        run_config({"parallel": {"cp": 2}, "algorithm": {"advantage_estimator": "ppo"}, "critic": {"config": "x.yaml"}})
    arch = arch_of("qwen3-4b")
    one = estimate(config(32768, train={"recompute": "full"}), arch, 1)
    two = estimate(config(32768, train={"recompute": "full"}, parallel={"cp": 2}), arch, 1)
    assert two.activations_gib == pytest.approx(one.activations_gib / 2)


BENCH_STEP_4B = {
    "rollout": {"prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 8192},
    "train": {"recompute": "full", "max_tokens_per_micro_batch": 4 * (128 + 8192)},
    "offload": {"train": True, "rollout": True},
}
"""The failed H200 run (benchmarks/results/logs/bench_step_qwen3-4b_64x8k_cudnn_oom_h200.log): ``rlrun bench step
--shape qwen3-4b --prompts 8 --samples 8 --new-tokens 8192 --micro-batch-samples 4 --recompute full``, 128-token
prompts, embedded engine, offload on, one rank."""


def test_phase_memory_of_the_4b_64x8k_bench_step_by_hand():
    """Each part against its formula written out with Qwen3-4B's numbers (36 layers, hidden 2560, 32 q / 8 kv heads
    of 128, MLP 9728, tied vocabulary 151936): the rollout holds the engine's 73 GiB KV cache; the train phase
    fits only because the engine has released it (what the warm batch's reference cycle once prevented)."""
    from rlrun.tools.phase_memory import phase_memory

    cfg = run_config({"model": {"dtype": "bfloat16"}, **BENCH_STEP_4B})
    phases = {
        p.phase: p for p in phase_memory(cfg, arch_of("qwen3-4b"), dp=1, world=1, device_gib=139.8, prompt_tokens=128)
    }
    gib = 2**30
    params = 36 * (2560 * (32 + 2 * 8) * 128 + 32 * 128 * 2560 + 3 * 2560 * 9728) + 151936 * 2560
    assert params == 4_022_272_000
    kv_per_token = 36 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16
    rollout = phases["rollout"].parts
    assert rollout["engine weights"] == pytest.approx(params * 2 / gib)
    assert rollout["engine KV cache (64 rows x 8320)"] == pytest.approx(64 * 8320 * kv_per_token / gib) == 73.125
    # int64 token, fp32 log-prob, bool mask, fp32 sampling noise (temperature 1)
    assert rollout["engine decode buffers"] == pytest.approx(64 * 8320 * 17 / gib)
    assert rollout["engine prefill K/V"] == pytest.approx(8 * 128 * kv_per_token / gib)
    assert rollout["trainer asleep"] == pytest.approx(1.4e9 / gib)
    assert phases["rollout"].total_gib == pytest.approx(82.81, abs=0.01)
    train = phases["train"].parts
    assert train["trainer static"] == pytest.approx(params * 18 / gib)  # bf16 weight, fp32 grad, main, Adam m + v
    tokens, layer_none = 33280, 2 * 2560 + 2 * (4096 + 2048) + 2 * 4096 + 2 * 2560 + 5 * 9728
    assert train["trainer activations"] == pytest.approx(tokens * (36 * 2560 + layer_none) * 2 / gib)
    assert "trainer optimizer-step temporary" not in train  # fused Adam steps in place (fuse_adam)
    assert train["engine context"] == pytest.approx(0.8e9 / gib) and "engine weights" not in train
    assert phases["train"].total_gib == pytest.approx(100.75 - params * 4 / gib, abs=0.01)  # foreach: 100.75
    # Megatron's host-offload optimizer steps its device half with foreach Adam: that half's temporary is back
    hybrid = run_config(
        {
            "model": {"dtype": "bfloat16"},
            **BENCH_STEP_4B,
            "optimizer": {"use_distributed_optimizer": True, "cpu_offload": True, "offload_fraction": 0.5},
        }
    )
    hybrid_train = {p.phase: p for p in phase_memory(hybrid, arch_of("qwen3-4b"), 1, 1, 139.8, 128)}["train"].parts
    assert hybrid_train["trainer optimizer-step temporary"] == pytest.approx(params * 4 * 0.5 / gib)
    logprobs = phases["logprobs"].parts  # one train micro-batch at a time, no grad: one layer's activations
    assert logprobs["trainer forward"] == pytest.approx(tokens * layer_none * 2 / gib)
    assert phases["logprobs"].total_gib < phases["train"].total_gib
    sync = phases["sync"].parts
    assert sync["engine weights"] == rollout["engine weights"] and sync["sync bucket"] == 0.5
    assert not any(name.startswith("engine KV") for name in sync)
    # the engine kept resident: its KV cache stays through training, and the train phase no longer fits
    resident = run_config({"model": {"dtype": "bfloat16"}, **BENCH_STEP_4B, "offload": {"train": True}})
    train = {p.phase: p for p in phase_memory(resident, arch_of("qwen3-4b"), 1, 1, 139.8, 128)}["train"]
    awake_engine = phases["rollout"].total_gib - rollout["trainer asleep"]
    assert train.total_gib == pytest.approx(phases["train"].total_gib - 0.8e9 / gib + awake_engine)
    assert train.total_gib > 139.8
    assert "set offload.rollout: true (the engine releases its memory)" in train.fixes


def test_phase_memory_rows_caps_and_fraction_pool():
    """Rows per engine: the round's prompts over ``world / engine.tp`` engines, capped by max_running_requests and
    rounded to the decode batch's row bucket; top-p adds the kept sets; SGLang's pool is its fraction of the
    device, weights included."""
    from rlrun.tools.phase_memory import engine_awake

    arch = arch_of("qwen3-0.6b")
    base = {"rollout": {"prompts_per_step": 6, "samples_per_prompt": 5, "max_new_tokens": 100}}
    cfg = run_config(base)
    assert "engine KV cache (16 rows x 128)" in engine_awake(cfg, arch, world=2, device_gib=None, prompt_tokens=20)
    capped = run_config({**base, "engine": {"server_args": {"max_running_requests": 20}}})
    assert "engine KV cache (32 rows x 256)" in engine_awake(capped, arch, 1, None, 30)  # 30 rows -> bucket 32
    top_p = run_config({"rollout": {**base["rollout"], "top_p": 0.9}})
    plain, kept = engine_awake(cfg, arch, 1, None, 20), engine_awake(top_p, arch, 1, None, 20)
    extra = kept["engine decode buffers"] - plain["engine decode buffers"]
    assert extra == pytest.approx(32 * 128 * 512 * 8 / 2**30)  # int64 kept set of 512 per row and column
    sglang = run_config({"engine": {"backend": "sglang", "tp": 2, "server_args": {"mem_fraction_static": 0.3}}})
    parts = engine_awake(sglang, arch, 2, device_gib=100.0, prompt_tokens=20)
    assert parts["engine weights"] + parts["engine KV pool (mem_fraction_static 0.3 less weights)"] == 30.0
    assert parts["engine weights"] == pytest.approx(rank_params(arch, 1, 1, 1) * 4 / 2 / 2**30)  # fp32 over tp 2


def test_doctor_fails_a_phase_over_the_device_and_names_the_fields(tiny_model_dirs):
    cfg = run_config(
        {
            "model": {"path": str(tiny_model_dirs["llama"])},
            "data": {"path": "configs/data/addition_train.jsonl"},
            "rollout": {"max_new_tokens": 64},
        }
    )
    checks = {c.name: c for c in config_checks(cfg, num_gpus=1, device_gib=0.001)}
    for phase in ("rollout", "logprobs", "train", "sync"):
        assert checks[f"memory: {phase}"].status == "missing", phase
    assert "set offload.train: true" in checks["memory: rollout"].detail
    assert "longest prompt" in checks["memory: rollout"].detail
    assert "lower train.max_tokens_per_micro_batch" in checks["memory: train"].detail
    roomy = {c.name: c for c in config_checks(cfg, num_gpus=1, device_gib=1000.0)}
    assert all(roomy[f"memory: {p}"].status == "ok" for p in ("rollout", "logprobs", "train", "sync"))
    on_cpu = {c.name: c for c in config_checks(cfg, num_gpus=0)}
    assert on_cpu["memory: train"].status == "info"


def test_phase_memory_with_engine_ranks_puts_trainer_and_engine_on_their_own_gpus():
    """``placement.engine_ranks``: a training rank's rows hold no engine part, the engine rank's row holds the engine
    the colocated rollout row holds plus its own process and two received buckets; no fix suggests ``offload.train`` or
    ``offload.rollout`` (refused with engine ranks)."""
    from rlrun.tools.phase_memory import TRAINER_CONTEXT_GIB, engine_awake, phase_memory

    settings = {"model": {"dtype": "bfloat16"}, **{k: v for k, v in BENCH_STEP_4B.items() if k != "offload"}}
    colocated = run_config(settings)
    split = run_config({**settings, "placement": {"engine_ranks": 1}})
    arch = arch_of("qwen3-4b")
    together = {p.phase: p for p in phase_memory(colocated, arch, 1, 1, 139.8, 128)}
    apart = {p.phase: p for p in phase_memory(split, arch, 1, 1, 139.8, 128)}
    assert set(apart) == {"rollout (engine rank)", "logprobs", "train", "sync"}
    for phase in ("logprobs", "train", "sync"):
        assert not any(name.startswith("engine") for name in apart[phase].parts), apart[phase].parts
        trainer_only = {k: v for k, v in together[phase].parts.items() if not k.startswith("engine")}
        assert apart[phase].parts == trainer_only
    engine_rank = apart["rollout (engine rank)"].parts
    assert {k: v for k, v in engine_rank.items() if k.startswith("engine ")} == engine_awake(split, arch, 1, 139.8, 128)
    assert engine_rank["rank process (CUDA, NCCL)"] == TRAINER_CONTEXT_GIB
    assert engine_rank["sync buckets received"] == pytest.approx(2 * 0.5)
    assert not any(name.startswith("trainer") for name in engine_rank)
    assert not any("offload.rollout" in fix or "offload.train" in fix for p in apart.values() for fix in p.fixes)
    assert any("offload.rollout" in fix for fix in together["train"].fixes)  # the colocated rows do suggest it
