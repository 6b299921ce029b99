"""Published Qwen3 model shapes and random-initialised HF directories of them.

Benchmarks need real sizes, not real weights: a random model of the published dimensions moves the
same bytes and does the same FLOPs, and it is built on the spot (no download, nothing over the
device's 64 MiB transfer limit). ``tiny`` exists so the benchmarks' code paths run on CPU in tests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    """The dimensions of one Qwen3 dense model (config.json names in the comments)."""

    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    intermediate: int  # intermediate_size
    tied: bool  # tie_word_embeddings
    head_dim: int = 128
    vocab: int = 151936


SHAPES: dict[str, Shape] = {
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, tied=True, head_dim=16, vocab=512),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072, tied=True),
    "qwen3-1.7b": Shape(hidden=2048, layers=28, heads=16, kv_heads=8, intermediate=6144, tied=True),
    "qwen3-4b": Shape(hidden=2560, layers=36, heads=32, kv_heads=8, intermediate=9728, tied=True),
    "qwen3-8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12288, tied=False),
}


def get_shape(name: str) -> Shape:
    """The shape called ``name``; accepts the short spelling ``0.6b`` for ``qwen3-0.6b``."""
    key = name if name in SHAPES else f"qwen3-{name}"
    if key not in SHAPES:
        raise ValueError(
            f"shape ({name!r}) must be one of {sorted(SHAPES)} because those are the published "
            "dimensions the benchmarks know; pick one of them"
        )
    return SHAPES[key]


def write_random_model(shape: Shape, out_dir: Path, dtype: torch.dtype, device: str) -> Path:
    """Save a random-init Qwen3ForCausalLM of ``shape`` to ``out_dir`` in ``dtype`` (safetensors) and
    return the directory. Initialised on ``device`` because an 8B init on CPU takes minutes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=40960,  # Qwen3's published value: long-response benchmarks reach 32K
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir)
    del model
    if torch.device(device).type == "cuda":  # the caller's trainer and engine share the card next: hand its cache back
        torch.cuda.empty_cache()
    return out_dir


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
