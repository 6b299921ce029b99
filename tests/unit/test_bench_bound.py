"""The rollout bench's HBM bound: a decode call's bytes per step (weights, and every row's K/V at the call's mean
context) checked against a step-by-step sum whose K/V bytes are those of a real transformers cache, and the card's
bandwidth read from its name."""

from __future__ import annotations

import pytest
import torch

from rlrun.tools.bench.rollout import BandwidthBound, card_hbm_bytes_per_s, kv_bytes_per_token
from rlrun.tools.bench.shapes import SHAPES, write_random_model


def _cache_bytes(model, batch: int, positions: int) -> int:
    """Bytes of the K/V transformers keeps after ``positions`` tokens of ``batch`` rows."""
    ids = torch.randint(2, 100, (batch, positions))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def test_bound_is_the_step_by_step_read_of_weights_and_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    batch, prompt_len, new_tokens, hbm = 3, 5, 4, 1e12
    model = AutoModelForCausalLM.from_pretrained(write_random_model(SHAPES["tiny"], tmp_path, torch.float32, "cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # Token i of each response comes from a forward that reads the weights and the cache of prompt_len + i positions.
    seconds = sum((weights + _cache_bytes(model, batch, prompt_len + i)) / hbm for i in range(new_tokens))
    bound = BandwidthBound.of(weights, hbm, batch, kv_bytes_per_token("tiny", 4), prompt_len, new_tokens)
    assert bound.tokens_per_s == pytest.approx(batch * new_tokens / seconds, rel=1e-12)
    assert bound.step_s == pytest.approx(seconds / new_tokens, rel=1e-12)
    assert bound.kv_bytes_per_token * batch * prompt_len == _cache_bytes(model, batch, prompt_len)
    assert bound.bytes_per_step == pytest.approx(bound.step_s * hbm)


def test_kv_bytes_of_a_qwen3_1_7b_position():
    assert kv_bytes_per_token("qwen3-1.7b", 2) == 28 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head_dim x bf16


@pytest.mark.parametrize(
    ("name", "rate"),
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12),
    ],
)
def test_card_bandwidth_by_name(name, rate):
    assert card_hbm_bytes_per_s(name) == rate


def test_an_unknown_card_names_the_flag():
    with pytest.raises(ValueError, match=r"--hbm-gbps must be set on 'cpu' because"):
        card_hbm_bytes_per_s("cpu")
