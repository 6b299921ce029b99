"""``rlrun bench rollout`` on the tiny shape, on CPU: the JSON's schema and maths checked against independent
references (a parameter-count formula, the bandwidth-bound definition). ``rlrun bench sync``'s are checked with
both backends in tests/integration/test_engine_sglang_fake.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rlrun.engine.registry import EXACT_GEMM_ENV
from rlrun.tools.bench.shapes import SHAPES, Shape


def expected_params(s: Shape) -> int:
    """Qwen3 parameter count from its published layout (q/k/v/o, gated MLP, RMSNorms, QK-norm)."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2 + 2 * s.head_dim
    layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    embeddings = s.vocab * s.hidden * (1 if s.tied else 2)
    return embeddings + s.layers * layer + s.hidden


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # what bench rollout sets itself
    subprocess.run(
        [sys.executable, "-m", "rlrun", "bench", *args, "--out", str(out)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        capture_output=True,
    )
    record = json.loads(out.read_text())
    assert record["benchmark"] == args[0] and record["command"].startswith(f"rlrun bench {args[0]}")
    return record


def test_shape_formula_matches_transformers_for_qwen3_0_6b():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = SHAPES["qwen3-0.6b"]
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
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == expected_params(s)


@pytest.mark.slow
def test_bench_rollout_tiny_cpu(tmp_path):
    batch, new_tokens, hbm_gbps = 3, 5, 1000.0
    record = run_bench(
        tmp_path,
        "rollout",
        "--shape",
        "tiny",
        "--batch",
        str(batch),
        "--prompt-len",
        "6",
        "--new-tokens",
        str(new_tokens),
        "--hbm-gbps",
        str(hbm_gbps),
        "--profile",
        str(tmp_path / "kernels.txt"),
    )
    r = record["results"][0]
    _check_decode_profile(r["decode_profile"], tmp_path / "kernels.txt", SHAPES["tiny"], batch, 6, hbm_gbps)
    assert r["cublas_workspace_config"] == EXACT_GEMM_ENV["CUBLAS_WORKSPACE_CONFIG"]  # the engine worker's
    weight_bytes = expected_params(SHAPES["tiny"]) * 4  # float32 on CPU
    assert (r["num_params"], r["weight_bytes"], r["dtype"]) == (
        expected_params(SHAPES["tiny"]),
        weight_bytes,
        "float32",
    )
    for side in ("engine", "engine_sampled", "hf_generate"):
        assert r[side]["output_tokens"] == batch * new_tokens  # ignore_eos / min_new_tokens force full length
        assert r[side]["tokens_per_s"] == pytest.approx(r[side]["output_tokens"] / r[side]["seconds"])
    kv = SHAPES["tiny"].layers * 2 * SHAPES["tiny"].kv_heads * SHAPES["tiny"].head_dim * 4  # a position's K, V
    step_s = (weight_bytes + batch * kv * (6 + (new_tokens - 1) / 2)) / (hbm_gbps * 1e9)  # mean context of the call
    assert r["bound"]["step_s"] == pytest.approx(step_s)
    assert r["bound"]["tokens_per_s"] == pytest.approx(batch / step_s)
    assert r["speedup_vs_hf"] == pytest.approx(r["engine"]["tokens_per_s"] / r["hf_generate"]["tokens_per_s"])
    assert r["fraction_of_bound"] == pytest.approx(r["engine"]["tokens_per_s"] / (batch / step_s))


def _check_decode_profile(p: dict, table, s: Shape, batch: int, prompt_len: int, hbm_gbps: float) -> None:
    """The profile's fields on CPU: categories that sum to the busy time, the bytes a step reads from the shape."""
    assert "Self CPU" in table.read_text() and p["table"] == str(table)
    assert (p["num_slots"], p["read_len"], p["steps"]) == (batch, 128, 8)  # 6 + 5 tokens: one bucket of 128
    assert set(p["category_s_per_step"]) == {"attention", "gemm", "sampling", "other"}
    assert min(p["category_s_per_step"].values()) > 0  # on CPU each category has ops: SDPA, mm, softmax, copies
    assert sum(p["category_s_per_step"].values()) == pytest.approx(p["busy_s_per_step"], rel=1e-9)
    assert p["busy_fraction"] == pytest.approx(p["busy_s_per_step"] / p["mean_step_s"])
    assert 0 < p["busy_fraction"] <= 1 and p["launches_per_step"] > 100
    kv = s.layers * 2 * batch * s.kv_heads * p["read_len"] * s.head_dim * 4  # K and V, fp32
    assert p["weight_bytes"] == expected_params(s) * 4 and p["kv_bytes_per_step"] == kv
    assert p["hbm_bytes_per_step"] == p["weight_bytes"] + kv
    assert p["bound_step_s"] == pytest.approx(p["hbm_bytes_per_step"] / (hbm_gbps * 1e9))
    assert p["host_issue_s_per_step"] == p["wall_s_per_step"] > 0  # on CPU the host runs the step
    assert p["device_s_per_step"] is p["host_gap_s_per_step"] is p["fraction_of_bound"] is None  # CUDA only


def test_kernel_categories_of_h200_kernel_and_cpu_op_names():
    from rlrun.tools.bench.decode_profile import category

    names = {
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "_decode_attention": "attention",  # rlrun/kernels/chunked_attention.py's kernels
        "_causal_attention": "attention",
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "aten::addmm": "gemm",
        "void at::native::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>": "sampling",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)": "sampling",
        "void at::native::tensor_kernel_scan_innermost_dim<float, std::plus<float> >(...)": "sampling",
        "aten::exp": "sampling",
        "aten::expand": "other",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>": "other",
        "Memcpy DtoD (Device -> Device)": "other",
    }
    assert {name: category(name) for name in names} == names


def test_bench_rollout_refuses_profile_with_sglang(tmp_path):
    from typer.testing import CliRunner

    from rlrun.tools.bench.cli import bench_app

    args = ["rollout", "--shape", "tiny", "--backends", "embedded,sglang", "--profile", str(tmp_path / "k.txt")]
    result = CliRunner().invoke(bench_app, args, env={"COLUMNS": "400"})  # one line: the message is not wrapped
    assert result.exit_code != 0 and "without the backends sglang because the profiler" in result.output
    assert not (tmp_path / "k.txt").exists()


@pytest.mark.parametrize(
    ("shapes", "extra", "message"),
    [
        ("tiny,nope", [], "shape ('nope') must be one of"),
        ("qwen3-0.6b,0.6b", [], "names 0.6b, qwen3-0.6b twice"),
        ("tiny,qwen3-0.6b", ["--profile", "k.txt"], "takes one --shape, not 2"),
    ],
)
def test_bench_rollout_checks_every_shape_before_running_any(tmp_path, shapes, extra, message):
    from typer.testing import CliRunner

    from rlrun.tools.bench.cli import bench_app

    extra = [str(tmp_path / e) if e.endswith(".txt") else e for e in extra]
    args = [
        "rollout",
        "--shape",
        shapes,
        "--batch",
        "2",
        "--new-tokens",
        "2",
        "--out",
        str(tmp_path / "r.json"),
        *extra,
    ]
    result = CliRunner().invoke(bench_app, args, env={"COLUMNS": "400"})  # one line: the message is not wrapped
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "r.json").exists()  # the valid first shape did not run


@pytest.mark.parametrize(
    ("shapes", "message"), [("tiny,nope", "shape ('nope') must be one of"), (",", "names no shape")]
)
def test_bench_sync_checks_its_shapes_as_rollout_does(tmp_path, shapes, message):
    from typer.testing import CliRunner

    from rlrun.tools.bench.cli import bench_app

    args = ["sync", "--shape", shapes, "--run-dir", str(tmp_path), "--out", str(tmp_path / "s.json")]
    result = CliRunner().invoke(bench_app, args, env={"COLUMNS": "400"})  # one line: the message is not wrapped
    assert result.exit_code != 0 and message in result.output, result.output
    assert not (tmp_path / "s.json").exists()
