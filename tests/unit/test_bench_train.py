"""``rlrun bench train``: the FLOP formula against torch's FLOP counter on a real HF forward + backward,
and the CLI's JSON on the tiny shape on CPU (its rates recomputed from its own step times)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from rlrun.tools.bench.shapes import SHAPES
from rlrun.tools.bench.train import matmul_params, training_flops


def counted_flops(lengths: list[int]) -> float:
    """torch.utils.flop_counter's count of forward + backward of an HF Qwen3 of the tiny shape, one
    sequence at a time, with eager attention (the full s x s score matrix as plain matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = SHAPES["tiny"]
    config = Qwen3Config(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied,
        attn_implementation="eager",
    )
    model = Qwen3ForCausalLM(config)
    total = 0
    for length in lengths:
        with FlopCounterMode(display=False) as counter:
            model(torch.randint(0, s.vocab, (1, length))).logits.sum().backward()
        total += counter.get_total_flops()
    return total


def test_flops_match_a_counted_forward_and_backward():
    shape, lengths = SHAPES["tiny"], [24, 40]
    assert training_flops(shape, lengths, causal=False) == counted_flops(lengths)
    # causal: the attention term (4 n_q d s^2 per layer forward, x3 for training) counts half
    attention = 3 * shape.layers * 4 * shape.heads * shape.head_dim * sum(n * n for n in lengths)
    assert training_flops(shape, lengths) == training_flops(shape, lengths, causal=False) - attention / 2
    # Qwen3-1.7B: 1.72e9 weights multiply every token (28 layers of 50.3M plus the 311M LM head)
    assert (
        matmul_params(SHAPES["qwen3-1.7b"])
        == 28 * (2048 * 32 * 128 + 16 * 128 * 2048 + 3 * 2048 * 6144) + 2048 * 151936
    )


@pytest.mark.slow
def test_cli_json_on_tiny_cpu(tmp_path):
    out = tmp_path / "train.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlrun",
            "bench",
            "train",
            "--shape",
            "tiny",
            "--layout",
            "packed,rows",
            "--sample-len",
            "80",
            "--samples-per-micro-batch",
            "2",
            "--micro-batches",
            "2",
            "--steps",
            "2",
            "--recompute",
            "full",
            "--recompute-num-layers",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        capture_output=True,
    )
    record = json.loads(out.read_text())
    assert record["benchmark"] == "train" and record["command"].startswith("rlrun bench train")
    packed, rows = record["results"]
    assert (packed["layout"], rows["layout"]) == ("packed", "rows")
    assert packed["micro_batches"] == rows["micro_batches"] == 2
    assert packed["memory"] == {
        "recompute": "full",
        "recompute_num_layers": 1,
        "lm_head": "chunked",
        "optimizer_cpu_offload": False,
        "offload_fraction": 1.0,
        "cp_size": 1,
    }
    for r in (packed, rows):
        median = statistics.median(r["step_seconds"])
        assert len(r["step_seconds"]) == 2 and r["tokens_per_step"] == 4 * 80
        assert r["flops_per_step"] == training_flops(SHAPES["tiny"], [80] * 4)
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / median)
        assert r["tflops"] == pytest.approx(r["flops_per_step"] / median / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 790.0)


def test_cli_passes_packed_attention_to_the_model(tmp_path):
    """``--packed-attention`` reaches ``build_model``: the CUDA-only varlen kernel is refused on CPU by the model's
    own check, in the CLI's one-line error."""
    cmd = [sys.executable, "-m", "rlrun", "bench", "train", "--shape", "tiny", "--sample-len", "80", "--steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [*cmd, "--packed-attention", "flash_varlen"], env=env, cwd=tmp_path, timeout=300, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "model.packed_attention (flash_varlen) needs CUDA" in proc.stderr, proc.stderr
