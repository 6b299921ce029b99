"""Megatron's multi-tensor fallbacks (no Apex, no TransformerEngine) by torch's foreach ops, without a host sync per
gradient tensor.

megatron-core 0.16.1 falls back to ``megatron.core.utils.local_multi_tensor_l2_norm`` for the gradient norm of every
optimizer step when neither Apex nor TransformerEngine is installed (rlrun installs neither). It takes each tensor's
norm on the device and then builds ``torch.tensor`` from the list of those 0-d CUDA tensors: a device-to-host copy,
so a host wait, per gradient tensor (19 a step of the tiny Qwen3 of tests/gpu/test_train_syncs_gpu.py, ~310 at
Qwen3-1.7B), each after one small kernel. Its ``local_multi_tensor_scale`` (the clip, and the copy of the main
parameters) launches two kernels a tensor. Here the norms are one ``torch._foreach_norm`` and their norm is taken on
the device (one host wait, Megatron's own ``.item()`` after the all-reduce); the scale is one ``_foreach_mul``. Same
formulas; the device's reductions instead of the host's for the norm of the norms (tests/unit/test_multi_tensor.py).
"""

from __future__ import annotations

import torch


def l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args):
    """``amp_C.multi_tensor_l2norm``'s contract as Megatron's fallback keeps it: ``([norm of all tensors], None)``,
    fp32, on the GPU where there is one (Megatron all-reduces it there, also when the gradients are on the host)."""
    tensors = [tensor for tensor_list in tensor_lists for tensor in tensor_list]  # never empty: Megatron checks
    norms = torch._foreach_norm(tensors)
    device = norms[0].device  # one device for the stack, should the lists mix them
    total = torch.linalg.vector_norm(torch.stack([norm.float().to(device) for norm in norms])).reshape(1)
    return (total.cuda() if torch.cuda.is_available() else total), None


def scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], factor: float) -> None:
    """``dst = src * factor`` for each pair of ``tensor_lists = [src, dst]``; in place when they are the same tensors
    (the clip)."""
    sources, targets = tensor_lists
    if not targets:  # a rank without gradients: Megatron's loop did nothing, the foreach ops refuse empty lists
        return
    if all(s is t for s, t in zip(sources, targets, strict=True)):
        torch._foreach_mul_(targets, factor)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, factor))


def patch_multi_tensor() -> None:
    """Replace Megatron's local fallbacks where its optimizer modules bound them (nothing when Apex or
    TransformerEngine supplied their kernels instead); idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    for module in (clip_grads, megatron_optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale
