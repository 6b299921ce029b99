"""Weight gradients accumulated by their GEMM straight into Megatron's fp32 ``main_grad``, without apex.

Megatron DDP gives every weight an fp32 ``main_grad``. Without apex's ``fused_weight_gradient_mlp_cuda`` extension,
each linear layer's backward writes a bf16 weight gradient and DDP's hook adds it into ``main_grad`` with a kernel of
its own: one fp32 ``add_`` a weight and micro-batch, a visible share of a train phase (BENCHMARKS.md, "Step against
peers", the profiles of the 1.7B resident step).
Megatron's gradient-accumulation fusion has the weight-gradient GEMM add into ``main_grad`` itself, through two
functions of that extension; torch's ``addmm`` with ``out_dtype`` (CUDA) is the first of them: bf16 operands, fp32
accumulation, ``beta = 1`` onto the fp32 gradient already there. The sums are the fp32 ones, where the unfused path
rounded each micro-batch's weight gradient to bf16 before adding it.

Turned on per linear layer of the decoder, after DDP has given its weights ``main_grad``, and on CUDA only. Not for
the output layer: when the embedding shares its weight, the embedding's gradient arrives through ``param.grad``,
which DDP's hook does not add for a weight whose gradient the GEMM already added (``grad_added_to_main_grad``).
"""

from __future__ import annotations

import torch

ACCUMULATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _WgradGemm:
    """What Megatron's linear layers call of apex's ``fused_weight_gradient_mlp_cuda``: ``main_grad +=
    grad_output^T @ input`` for ``input [tokens, in]``, ``grad_output [tokens, out]``, ``main_grad [out, in]``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        accumulate_fp32(main_grad, grad_output, total_input)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def accumulate_fp32(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` in one GEMM: fp32 ``main_grad``, bf16/fp16 operands (CUDA; the
    sum is the fp32 one, where ``+=`` of a separate GEMM would round the product to bf16 first)."""
    torch.ops.aten.addmm.dtype_out(main_grad, grad_output.t(), total_input, torch.float32, out=main_grad)


def supported() -> bool:
    """Whether this torch has the mixed-precision ``addmm`` the fp32 accumulation needs."""
    return "dtype_out" in torch.ops.aten.addmm.overloads()


def fuse_weight_gradient_accumulation(gpt: torch.nn.Module) -> int:
    """Turn on the fusion for every trainable linear layer of ``gpt``'s decoder whose weight is on CUDA and has its
    ``main_grad`` (call after wrapping in DDP); returns how many. Nothing changes on CPU or without the ``addmm``."""
    from megatron.core.tensor_parallel import layers

    decoder = getattr(gpt, "decoder", None)
    if decoder is None or not supported():
        return 0
    fused = 0
    for module in decoder.modules():
        if not isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
            continue
        weight = getattr(module, "weight", None)
        if (
            weight is None
            or not weight.requires_grad
            or not weight.is_cuda
            or getattr(weight, "main_grad", None) is None
            or weight.main_grad.dtype not in ACCUMULATING_DTYPES
        ):
            continue
        module.gradient_accumulation_fusion = True
        fused += 1
    if fused and getattr(layers, "fused_weight_gradient_mlp_cuda", None) is None:  # apex's, where installed, stays
        layers.fused_weight_gradient_mlp_cuda = _WgradGemm  # the module global Megatron's backward calls
    return fused
