"""On the GPU in bf16, the embedded engine samples from the trainer's policy at Qwen3's real widths and a GRPO
step's length: ``rlrun bench step`` (random weights of the published shape, 16 prompts x 8 samples of 128 + 512
tokens) logs ``train/logprob_gap`` of at most 1e-6 at both steps (step 1 after an update and a weight sync).
0.6B and 1.7B run with trainer and engine resident on a card of 120 GiB or more (the 1.7B resident step peaks at
~100 GB); 4B, and every shape on a smaller card, with offload (they take turns on the device) and micro-batches of 8
samples: 4B's trainer holds ~72 GB of weights, gradients and Adam state, so on a card under 120 GiB Adam's state also
stays on the host (``optimizer.cpu_offload``), which takes a host of 192 GiB (4B is skipped on a smaller one).
Offload and the micro-batch split move memory, not the arithmetic either side does for a token, so the gate reads the
same.

The gates of test_onpolicy_gpu.py and test_head_norm_gpu.py run SmolLM2 and a tiny Qwen3 with short responses.
At these widths and lengths a split-K down projection (fixed by the engine's zero cuBLAS workspace) and RoPE
frequencies computed on two devices (fixed in rlrun/megatron/rope.py) kept the engine 4e-3 to 6e-3 nats a token
off (docs/on_policy.md). About 2 minutes a shape on an H200.

    OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider tests/gpu/test_onpolicy_qwen3_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from rlrun.tools.bench.step import StepSettings, Variant, bench_step

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


SHAPES = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")
RESIDENT = ("qwen3-0.6b", "qwen3-1.7b")
"""Shapes that run resident, with micro-batches of 32 samples, where the card holds :data:`RESIDENT_CARD_BYTES`."""
RESIDENT_CARD_BYTES = 120 * 2**30
HOST_BYTES_FOR_ADAM_ON_HOST = 192 * 2**30
"""Host memory the 4B step needs with Adam's state there: on a host of 128 GiB (Adam's ~64 GB beside the trainer's and
the engine's host copies while they take turns) the kernel's out-of-memory killer ended the trainer."""


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("shape", SHAPES)
def test_embedded_engine_is_on_policy_at_a_qwen3_shape(shape, tmp_path):
    offload = shape not in RESIDENT or torch.cuda.get_device_properties(0).total_memory < RESIDENT_CARD_BYTES
    micro_batch_samples = 8 if offload else 32
    # Adam's state on the host where the card cannot hold it: the update runs elsewhere, the gap compares trainer and
    # engine under the same weights either way
    optimizer_offload = shape not in RESIDENT and torch.cuda.get_device_properties(0).total_memory < RESIDENT_CARD_BYTES
    if optimizer_offload and _host_bytes() < HOST_BYTES_FOR_ADAM_ON_HOST:
        card = torch.cuda.get_device_properties(0).total_memory
        pytest.skip(
            f"{shape} needs a card of {RESIDENT_CARD_BYTES >> 30} GiB or a host of "
            f"{HOST_BYTES_FOR_ADAM_ON_HOST >> 30} GiB for Adam's state (here: {card >> 30} GiB card, "
            f"{_host_bytes() >> 30} GiB host)"
        )
    settings = StepSettings(shape=shape, backend="embedded", steps=2, micro_batch_samples=micro_batch_samples)
    variant = Variant(offload=offload, lm_head="chunked_kept", optimizer_offload=optimizer_offload)
    result = bench_step(settings, tmp_path, 600.0, variant)
    gaps = [step.logprob_gap for step in result.steps]
    assert len(gaps) == 2 and all(gap is not None and gap <= 1e-6 for gap in gaps), gaps
