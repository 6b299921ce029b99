"""RoPE variants (rlrun/megatron/rope.py) against transformers' own ``ROPE_INIT_FUNCTIONS`` (the reference the
embedded engine runs), on config.json dicts in both the current (``rope_parameters``) and the older
(``rope_scaling`` + top-level ``rope_theta``) format; and why Megatron's llama3 scaling is not used."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlrun.megatron.hf_config import ModelArch
from rlrun.megatron.rope import rope_from_config

BASE = {
    "model_type": "llama",
    "hidden_size": 96,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "max_position_embeddings": 4096,
    "rope_theta": 50000.0,
}
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CASES = {
    "default": (BASE, None),
    "linear": (BASE, {"rope_type": "linear", "factor": 3.0}),
    "llama3_31": (BASE, {**LLAMA31, "original_max_position_embeddings": 8192}),
    "llama3_custom": (
        BASE,
        {"rope_type": "llama3", "factor": 5.0, "low_freq_factor": 2.0, "high_freq_factor": 7.0,
         "original_max_position_embeddings": 512},
    ),
    "llama3_no_original": (BASE, LLAMA31),  # transformers falls back to max_position_embeddings
    "yarn_qwen": ({**BASE, "model_type": "qwen2"}, {"type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 1024}),
    "yarn_mscale": (BASE, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                           "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 128}),
    "yarn_attention_factor": (BASE, {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                                     "original_max_position_embeddings": 2048}),
    "yarn_no_factor": (BASE, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 1024}),
    "yarn_untruncated": (BASE, {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                "original_max_position_embeddings": 1024}),
}  # fmt: skip


def _hf(cfg: dict) -> tuple[torch.Tensor, float]:
    """transformers' rotary module of this config: its ``inv_freq`` and the factor it multiplies cos/sin by."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(AutoConfig.for_model(**cfg))
    return rotary.inv_freq, rotary.attention_scaling


@pytest.mark.parametrize("fmt", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_and_attention_factor_equal_transformers(case, fmt):
    base, scaling = CASES[case]
    if fmt == "rope_scaling":  # older config.json: rope_scaling beside a top-level rope_theta
        cfg = {**base, "rope_scaling": scaling}
    else:  # what transformers 5 writes: everything inside rope_parameters
        rope = {"rope_type": "default", **(scaling or {}), "rope_theta": base["rope_theta"]}
        cfg = {k: v for k, v in base.items() if k != "rope_theta"} | {"rope_parameters": rope}
        if "partial_rotary_factor" in cfg:
            rope["partial_rotary_factor"] = cfg.pop("partial_rotary_factor")
    want_inv_freq, want_factor = _hf(dict(cfg))
    rope = rope_from_config(cfg, head_dim=16, path=Path("config.json"))
    assert torch.equal(rope.inv_freq(), want_inv_freq), (rope.inv_freq(), want_inv_freq)
    assert rope.yarn_attention_factor == want_factor
    assert rope.dim == want_inv_freq.numel() * 2
    if want_factor != 1.0:
        assert rope.softmax_scale == pytest.approx(want_factor**2 / math.sqrt(16), rel=1e-15)
    else:
        assert rope.softmax_scale is None


def test_scaling_changes_the_frequencies():
    """The cases above exercise the scaling: llama3 keeps high frequencies, divides low ones by the factor."""
    default = rope_from_config(BASE, 16, Path("c")).inv_freq()
    llama3 = rope_from_config({**BASE, "rope_scaling": CASES["llama3_custom"][1]}, 16, Path("c")).inv_freq()
    assert llama3[0] == default[0] and torch.allclose(llama3[-1], default[-1] / 5.0)
    assert ((llama3 != default) & (llama3 != default / 5.0)).any()  # some are smoothed in between


def test_megatron_llama3_scaling_hard_codes_its_parameters():
    """Why rope.py computes llama3 itself: Megatron's ``_apply_scaling`` (given only ``factor``) equals
    transformers for Llama 3.1's (1, 4, 8192) and differs for any other low/high/original values."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for case, equal in (("llama3_31", True), ("llama3_custom", False)):
        scaling = CASES[case][1]
        ours = rope_from_config({**BASE, "rope_scaling": scaling}, 16, Path("c")).inv_freq()
        megatron = RotaryEmbedding(
            kv_channels=16,
            rotary_percent=1.0,
            rotary_base=BASE["rope_theta"],
            rope_scaling=True,
            rope_scaling_factor=scaling["factor"],
            use_cpu_initialization=True,
        ).inv_freq
        assert torch.equal(ours, megatron) is equal, case


@pytest.mark.parametrize("case", ["default", "yarn_qwen"])
def test_apply_to_sets_megatron_rotary_frequencies(case):
    """Also the default variant, whose formula Megatron shares but evaluates on the GPU: here its table is made one
    ulp off (as a device's ``pow`` may round), and ``apply_to`` must replace it with transformers' host-computed
    one, the table the embedded engine rotates by."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    base, scaling = CASES[case]
    rope = rope_from_config({**base, "rope_scaling": scaling}, 16, Path("c"))
    rotary = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=50000.0, use_cpu_initialization=True)
    rotary.inv_freq = torch.nextafter(rotary.inv_freq, torch.zeros_like(rotary.inv_freq))
    rope.apply_to(rotary)
    assert torch.equal(rotary.inv_freq, _hf(dict(base) | {"rope_scaling": scaling})[0])


@pytest.mark.parametrize(
    "scaling, reason",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "length of each batch"),
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, "two frequency tables"),
        ({"rope_type": "su"}, "only these RoPE variants"),
    ],
)
def test_refused_rope_types_name_the_field_and_reason(scaling, reason):
    with pytest.raises(ValueError, match=rf"rope_parameters.rope_type \('{scaling['rope_type']}'\) must be .*{reason}"):
        ModelArch.from_dict({**BASE, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 300,
                             "rms_norm_eps": 1e-5, "rope_scaling": scaling})  # fmt: skip
