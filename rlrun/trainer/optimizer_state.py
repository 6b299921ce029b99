"""The optimizer's own state as views of one device buffer per dtype, copied to the host and back by the offloader
itself, so that a wake's copy back runs on a side stream behind the forward and backward passes.

torch_memory_saver copies a paused region back with a synchronous ``cudaMemcpy`` on the legacy default stream,
which waits for every kernel queued before it and holds back every kernel after it. The optimizer's state (fp32
main weights and Adam moments, 12 of the 14 bytes a parameter that a sleep moves) is read by nothing before the
optimizer step, so its copy back need not hold back the forward pass: at 1.7B parameters it is 20 GB, ~0.5 s of
each wake at the H200's host bandwidth (BENCHMARKS.md, "Step: rlrun vs verl"). Here it is one ``copy_`` per dtype
on a stream of its own, and the step waits for it on the device. The buffers live in the offloader's scratch
region (paused and mapped again without a copy); the model's weights, which the forward reads first, stay in the
trainer region with the saver's synchronous copy.

What is not in the buffers (the step counts, a tensor a later optimizer version adds) is wherever it was
allocated, outside every region (``Offloader.optimizer_region``): it stays on the device through a sleep, so
missing a tensor costs memory, never its contents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import torch

from rlrun.megatron.train import adam_step, optimizer_parts

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

P = ParamSpec("P")
R = TypeVar("R")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def streams_state(optimizer: MegatronOptimizer) -> bool:
    """Whether every part of ``optimizer`` steps with torch's Adam(W) on the device, whose state this module holds;
    Megatron's host Adam (``optimizer.cpu_offload``) keeps its state its own way."""
    adams = (torch.optim.Adam, torch.optim.AdamW)
    return all(type(getattr(part, "optimizer", None)) in adams for part in optimizer_parts(optimizer))


class FlatOptimizerState:
    """The state tensors of ``optimizer`` (its own weights, i.e. the fp32 main weights, not the model's; every state
    tensor that is not a scalar, i.e. the Adam moments) placed in buffers allocated inside ``region``, with a pinned
    host copy made at :meth:`save_to_host` and copied back asynchronously by :meth:`load_from_host`."""

    def __init__(
        self,
        optimizer: MegatronOptimizer,
        model_params: Iterable[torch.Tensor],
        region: Callable[[], AbstractContextManager],
    ) -> None:
        self._optimizer = optimizer
        # the distributed optimizer's fp32 shards of an fp32 model are views of the model's weights: not its own
        self._model_storages = {p.untyped_storage().data_ptr() for p in model_params}
        self._region = region
        self._layout: list[tuple[torch.dtype, torch.Size]] = []
        self._slots: list[torch.Tensor] = []
        self._device: dict[torch.dtype, torch.Tensor] = {}
        self._host: dict[torch.dtype, torch.Tensor] = {}
        self._pinned: set[int] = set()
        self._stream: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None
        self.adopt()

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(buffer) for buffer in self._device.values())

    def tensors(self) -> list[torch.Tensor]:
        """What the buffers hold, in a fixed order."""
        return [tensor for tensor, _, _ in self._plan() if tensor is not None]

    def _plan(self) -> list[tuple[torch.Tensor | None, torch.Tensor, Callable[[torch.Tensor], None] | None]]:
        """(tensor, what its slot is shaped like, how a missing tensor is set) for every slot. A parameter without
        Adam state gets its step count now and its moments in their slots (``adopt``): created first and copied,
        they would hold the device twice over at once."""
        plan: list[tuple[torch.Tensor | None, torch.Tensor, Callable[[torch.Tensor], None] | None]] = []
        for part in optimizer_parts(self._optimizer):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    if param.untyped_storage().data_ptr() not in self._model_storages:
                        plan.append((param, param, None))
                    state = inner.state[param]
                    if not state and param.is_contiguous():  # as torch's Adam creates it at the first step
                        state["step"] = adam_step(0, param, group)
                        plan.extend((None, param, functools.partial(state.__setitem__, key)) for key in ADAM_MOMENTS)
                    else:
                        plan.extend((v, v, None) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return [entry for entry in plan if entry[1].is_contiguous()]

    def adopt(self) -> None:
        """Place every tensor of the plan in the buffers (a copy, then the tensor's data pointed there): at
        construction, and before every save, since loading a checkpoint replaces the state with new tensors."""
        self.wait()
        plan = self._plan()
        layout = [(like.dtype, like.shape) for _, like, _ in plan]
        if layout != self._layout:
            self._allocate(layout, plan[0][1].device if plan else torch.device("cpu"))
        for (tensor, _, place), slot in zip(plan, self._slots, strict=True):
            if tensor is None:
                assert place is not None
                place(slot.zero_())
            elif tensor.data_ptr() != slot.data_ptr():
                slot.copy_(tensor)
                tensor.data = slot

    def _allocate(self, layout: list[tuple[torch.dtype, torch.Size]], device: torch.device) -> None:
        sizes: dict[torch.dtype, int] = {}
        for dtype, shape in layout:
            sizes[dtype] = sizes.get(dtype, 0) + shape.numel()
        with self._region():
            self._device = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self._release_host()
        offsets = dict.fromkeys(sizes, 0)
        self._slots = []
        for dtype, shape in layout:
            start = offsets[dtype]
            self._slots.append(self._device[dtype][start : start + shape.numel()].view(shape))
            offsets[dtype] = start + shape.numel()
        self._layout = layout

    def save_to_host(self) -> None:
        """Copy the state to its pinned host buffers (allocated at the first save and kept: pinning anew each time
        costs more than the copy); returns when the copy is done, so the device buffers may be paused."""
        self.adopt()
        for dtype, buffer in self._device.items():
            if dtype not in self._host:
                self._host[dtype] = torch.empty(buffer.shape, dtype=dtype)
                if buffer.is_cuda:  # pinned in place: torch's pinned allocator rounds up to a power of two
                    _check(torch.cuda.cudart().cudaHostRegister(self._host[dtype].data_ptr(), _nbytes(buffer), 0))
                    self._pinned.add(self._host[dtype].data_ptr())
            self._host[dtype].copy_(buffer)

    def _release_host(self) -> None:
        for host in self._host.values():
            if host.data_ptr() in self._pinned:
                _check(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))
        self._host, self._pinned = {}, set()

    def load_from_host(self) -> None:
        """Start the copy back (on CUDA on a side stream, after the device buffers are mapped again); the next
        :meth:`wait` orders the current stream after it."""
        if not self._host:
            return
        if not any(buffer.is_cuda for buffer in self._device.values()):
            for dtype, buffer in self._device.items():
                buffer.copy_(self._host[dtype])
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dtype, buffer in self._device.items():
                buffer.copy_(self._host[dtype], non_blocking=True)
        self._ready = self._stream.record_event()

    def wait(self) -> None:
        """Make the current stream wait for the copy back (on the device: the host does not block)."""
        if self._ready is not None:
            torch.cuda.current_stream().wait_event(self._ready)
            self._ready = None

    def waiting_first(self, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` (an optimizer method that reads its state) run after :meth:`wait`."""

        @functools.wraps(fn)
        def after_wait(*args: P.args, **kwargs: P.kwargs) -> R:
            self.wait()
            return fn(*args, **kwargs)

        return after_wait


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check(error: object) -> None:
    if int(error) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"pinning the optimizer state's host copy failed: CUDA error {int(error)}")  # type: ignore[call-overload]
