"""Make megatron-core 0.16.1 run on a CPU-only torch build (gloo), for tests and the CPU quickstart.

megatron-core assumes CUDA in a handful of places. Each patch below fixes one of them; all of them
were found by running Megatron on CPU:

* ``torch.cuda.current_device`` returns ``cpu``: the rotary embedding moves ``inv_freq`` to
  ``torch.cuda.current_device()`` on every forward.
* The model-parallel RNG tracker uses the CPU generator: ``model_parallel_cuda_manual_seed`` and the
  tracker's ``fork()`` (entered around attention dropout even when p=0) read and write the CUDA RNG.
* ``torch.cuda.synchronize`` is a no-op: pipeline p2p communication calls it after every exchange.
* A ``TorchFunctionMode`` rewrites CUDA devices to CPU: the schedules, the optimizer and the default
  causal mask create tensors with ``device="cuda"`` and call ``.cuda()``.
* The same mode makes argument-less ``Tensor.type()`` report ``torch.cuda.*``: the Megatron optimizer
  asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` when clipping, and the bf16 and
  distributed optimizers refuse parameters whose type is not a CUDA type. The check is about the
  dtype; the CUDA prefix is the only thing that differs on CPU.

Apply only when ``not torch.cuda.is_available()``: on a GPU none of this is needed and all of it would
be wrong. The mode is entered once and left active for the life of the process (it is thread-local;
Megatron runs forward, backward and the optimizer on the calling thread on CPU).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_cpu_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare integer device (``device=0``) means a CUDA ordinal in torch.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Runs every torch call as if ``cuda`` said ``cpu``; see the module docstring for why."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


def apply_cpu_patches() -> None:
    """Patch torch.cuda and Megatron's RNG tracker for a CPU-only process; idempotent."""
    global _cpu_mode
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_patches must not run on a CUDA machine: Megatron runs natively there")
    if _cpu_mode is not None:
        return
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _cpu_mode = _CudaToCpuMode()
    _cpu_mode.__enter__()
