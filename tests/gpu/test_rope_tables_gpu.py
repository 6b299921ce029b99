"""On a GPU, the bf16 ``cos`` and ``sin`` the trainer rotates by are the embedded engine's, bit for bit, for every
position up to 32K, at the RoPE settings of the families people train.

The engine's are transformers': its rotary module computes the frequencies on the host when the model loads
(``from_pretrained``, then ``.to(device)``: rlrun/engine/embedded/engine.py) and ``cos`` / ``sin`` in its
forward. The trainer's are Megatron's ``RotaryEmbedding`` built on the GPU, as rlrun builds it, given rlrun's
frequencies (rlrun/megatron/rope.py, ``apply_to``), with rope_apply's ``cos`` / ``sin``. Megatron alone computes the
default variant's frequencies on the GPU, whose ``pow`` may round one apart from the host's; a frequency one ulp off
turns long positions' angles enough to round some bf16 values apart (docs/on_policy.md).

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_rope_tables_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

POSITIONS = 32768
FAMILIES = {
    "qwen3": ({"model_type": "qwen3", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8,
               "head_dim": 128, "rope_theta": 1000000.0, "max_position_embeddings": 40960}, 128),
    "smollm2": ({"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                 "rope_theta": 100000.0, "max_position_embeddings": 8192}, 64),
    "llama3_1": ({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "rope_theta": 500000.0, "max_position_embeddings": 131072,
                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, 128),
}  # fmt: skip


def _engine_tables(cfg: dict, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``[POSITIONS, head_dim]`` bf16 cos and sin, its module built on the host and moved."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rotary_class = Qwen3RotaryEmbedding if cfg["model_type"] == "qwen3" else LlamaRotaryEmbedding
    rotary = rotary_class(AutoConfig.for_model(**cfg)).to("cuda")
    x = torch.zeros(1, 1, POSITIONS, head_dim, dtype=torch.bfloat16, device="cuda")
    cos, sin = rotary(x, torch.arange(POSITIONS, device="cuda")[None])
    return cos[0], sin[0]


def _trainer_tables(cfg: dict, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Megatron's bf16 cos and sin as the trainer has them, and how many of the frequencies Megatron computed on the
    GPU (its default formula: a scaled variant differs in all it scales) differ from the ones rlrun gives it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from rlrun.megatron.rope import rope_from_config
    from rlrun.megatron.rope_apply import _cos_sin

    rope = rope_from_config(cfg, head_dim, Path("config.json"))
    rotary = RotaryEmbedding(
        kv_channels=head_dim, rotary_percent=1.0, rotary_base=rope.theta, use_cpu_initialization=False
    )
    own = rotary.inv_freq.clone()
    rope.apply_to(rotary)
    freqs = rotary(POSITIONS)  # [S, 1, 1, D] fp32
    cos, sin, _ = _cos_sin(freqs, 1.0, torch.bfloat16, halves_equal=False)
    return cos[:, 0, 0], sin[:, 0, 0], int((own != rotary.inv_freq).sum())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_and_engine_rotate_by_the_same_bits(family):
    cfg, head_dim = FAMILIES[family]
    engine_cos, engine_sin = _engine_tables(cfg, head_dim)
    trainer_cos, trainer_sin, gpu_computed_apart = _trainer_tables(cfg, head_dim)
    apart = int((engine_cos != trainer_cos).sum() + (engine_sin != trainer_sin).sum())
    assert apart == 0, (
        f"{apart} of {2 * engine_cos.numel()} bf16 cos/sin values differ "
        f"({gpu_computed_apart} of Megatron's own GPU-computed frequencies differed from the ones rlrun gave it)"
    )
