"""The Megatron MLP comparison that tests/unit/test_swiglu.py (CPU) and tests/gpu/test_swiglu_gpu.py (CUDA, the
Triton kernel) run: megatron-core's own ``MLP.forward`` against rlrun's patched one (rlrun/megatron/swiglu_apply.py)
on the same weights and inputs, forward bits and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def eager_swiglu(x: torch.Tensor) -> torch.Tensor:
    """The forward the kernel reproduces: Megatron's ``glu`` (and transformers' MLP) on ``x [..., 2F]``."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def fp32_swiglu_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient the kernel's backward computes, by fp32 autograd, rounded once to ``x``'s dtype."""
    x32 = x.detach().float().requires_grad_()
    with torch.enable_grad():  # also inside a backward (the CPU test's stand-in for the kernel's)
        eager_swiglu(x32).backward(grad.float())
    assert x32.grad is not None
    return x32.grad.to(x.dtype)


def mlp_config(dtype: torch.dtype, ffn: int, **overrides):
    """A one-layer Megatron config as rlrun builds them (rlrun/megatron/hf_config.py), gated SiLU, unfused."""
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=64,
        ffn_hidden_size=ffn,
        num_attention_heads=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def mlp_comparison(device: str, dtype_name: str, ffn: int, bias: bool, eager_kernel: bool = False) -> dict:
    """Megatron's forward against the patched one in a one-rank world on ``device``. ``eager_kernel``: the kernel
    calls replaced by eager PyTorch and taken on any device (CPU: the patch's plumbing, fc1 to fc2, bias, the
    autograd wiring and the gradient's [gate | up] layout). Returns the checks and how often the kernel ran."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from rlrun.megatron import swiglu_apply
    from rlrun.runtime.dist import init_distributed

    parallel = init_distributed(tp=1, pp=1, seed=0)
    swiglu_apply.patch_swiglu()
    swiglu_apply.patch_swiglu()  # idempotent: the reference stays Megatron's
    megatron_forward = MLP.forward.megatron  # type: ignore[attr-defined]
    assert not getattr(megatron_forward, "rlrun", False)
    if eager_kernel:
        swiglu_apply.kernel_covers = lambda hidden_states: True
        swiglu_apply._forward_kernel = eager_swiglu
        swiglu_apply._backward_kernel = fp32_swiglu_grad
    calls = []
    apply = swiglu_apply._SwiGLU.apply
    swiglu_apply._SwiGLU.apply = lambda x: calls.append(1) or apply(x)  # type: ignore[method-assign]

    dtype = getattr(torch, dtype_name)
    config = mlp_config(dtype, ffn, add_bias_linear=bias)
    torch.manual_seed(0)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mlp = MLP(config, submodules, ffn_hidden_size=ffn).to(device)
    with torch.no_grad():
        for p in mlp.parameters():  # weights and biases at a scale where SiLU is far from linear
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(dtype) * 0.3)
    x0 = (2 * torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    grad = torch.randn(7, 3, 64, generator=torch.Generator().manual_seed(2)).to(device, dtype)

    def run(forward, **kwargs):
        mlp.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out, out_bias = forward(mlp, x, **kwargs)
        loss = (out * grad).sum()
        if out_bias is not None:  # fc2's bias, returned for the layer to add (skip_bias_add)
            loss = loss + (out_bias * grad.sum((0, 1))).sum()
        loss.backward()
        grads = {"input": x.grad, **{n: p.grad for n, p in mlp.named_parameters()}}
        return out.detach(), out_bias, grads

    want, want_bias, want_grads = run(megatron_forward)
    before = len(calls)
    got, got_bias, got_grads = run(type(mlp).__call__)
    kernel_calls = len(calls) - before
    errors = {
        name: ((got_grads[name].float() - g.float()).abs().max() / g.float().abs().max()).item()
        for name, g in want_grads.items()
    }
    # Experts pass the routing probabilities as per_token_scale: Megatron's own path, kernel or not (without a
    # bias: Megatron's scaled bias add is in place on a view, which autograd refuses on a one-rank group).
    scaled_equal, scaled_calls = None, 0
    if not bias:
        probs = torch.rand(7, 3, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        before = len(calls)
        scaled_want = run(megatron_forward, per_token_scale=probs)[0]
        scaled_equal = torch.equal(run(type(mlp).__call__, per_token_scale=probs)[0], scaled_want)
        scaled_calls = len(calls) - before
    swiglu_apply._SwiGLU.apply = apply  # type: ignore[method-assign]
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    return {
        "forward_bits": torch.equal(got.view(bits), want.view(bits)),  # -0.0 is not 0.0
        "bias": (got_bias is None) == (want_bias is None),
        "grad_relative_errors": errors,
        "grad_names": sorted(want_grads),
        "kernel_calls": kernel_calls,
        "scaled_equal": scaled_equal,
        "scaled_kernel_calls": scaled_calls,
        "device": str(parallel.device),
    }
