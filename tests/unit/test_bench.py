"""``rlrun bench rollout`` / ``rlrun bench sync`` on the tiny shape, on CPU: the JSON's schema and maths
checked against independent references (a parameter-count formula, the bandwidth-bound definition)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from rlrun.bench.shapes import SHAPES, Shape


def expected_params(s: Shape) -> int:
    """Qwen3 parameter count from its published layout (q/k/v/o, gated MLP, RMSNorms, QK-norm)."""
    attn = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2 + 2 * s.head_dim
    layer = attn + 3 * s.hidden * s.intermediate + 2 * s.hidden
    embeddings = s.vocab * s.hidden * (1 if s.tied else 2)
    return embeddings + s.layers * layer + s.hidden


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
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
    )
    r = record["results"][0]
    weight_bytes = expected_params(SHAPES["tiny"]) * 4  # float32 on CPU
    assert (r["num_params"], r["weight_bytes"], r["dtype"]) == (
        expected_params(SHAPES["tiny"]),
        weight_bytes,
        "float32",
    )
    for side in ("engine", "engine_sampled", "hf_generate"):
        assert r[side]["output_tokens"] == batch * new_tokens  # ignore_eos / min_new_tokens force full length
        assert r[side]["tokens_per_s"] == pytest.approx(r[side]["output_tokens"] / r[side]["seconds"])
    step_s = weight_bytes / (hbm_gbps * 1e9)
    assert r["bound"]["step_s"] == pytest.approx(step_s)
    assert r["bound"]["tokens_per_s"] == pytest.approx(batch / step_s)
    assert r["speedup_vs_hf"] == pytest.approx(r["engine"]["tokens_per_s"] / r["hf_generate"]["tokens_per_s"])
    assert r["fraction_of_bound"] == pytest.approx(r["engine"]["tokens_per_s"] / (batch / step_s))


@pytest.mark.slow
def test_bench_sync_tiny_cpu(tmp_path):
    record = run_bench(
        tmp_path, "sync", "--shape", "tiny", "--repeats", "3", "--bucket-mib", "1", "--run-dir", str(tmp_path / "run")
    )
    (r,) = record["results"]
    weight_bytes = expected_params(SHAPES["tiny"]) * 4  # tied: the embedding is sent once
    assert (r["shape"], r["weight_bytes"], r["num_buckets"]) == ("tiny", weight_bytes, 1)
    assert len(r["seconds"]) == len(r["probe_s"]) == 3
    assert r["median_s"] == pytest.approx(statistics.median(r["seconds"]))
    assert r["gb_per_s"] == pytest.approx(weight_bytes / r["median_s"] / 1e9)
