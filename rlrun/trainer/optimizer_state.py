"""The optimizer's own state as views of a few device buffers, copied to the host and back by the offloader itself,
so that a wake's copy back runs on a side stream behind the forward and backward passes.

torch_memory_saver copies a paused region back with a synchronous ``cudaMemcpy`` on the legacy default stream,
which waits for every kernel queued before it and holds back every kernel after it. The optimizer's state (fp32
main weights and Adam moments, 12 of the 14 bytes a parameter that a sleep moves) is read by nothing before the
optimizer step, so its copy back need not hold back the forward pass: at 1.7B parameters it is 20 GB, ~0.5 s of
each wake at the H200's host bandwidth (BENCHMARKS.md, "Step: rlrun vs verl"). Here it is one ``copy_`` per buffer
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import torch

from rlrun.megatron.train import adam_step, optimizer_parts

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

P = ParamSpec("P")
R = TypeVar("R")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
COPY_PIECE_BYTES = 64 << 20
"""The wake's copy back goes in pieces of this size (~1 ms each at the H200's ~55 GB/s from the host). A copy engine
finishes a transfer before it takes the next, so one 20 GB transfer (1.7B parameters) queued at the wake would hold
back every later host-to-device copy, on any stream, for ~0.4 s: the train phase's micro-batches are copied to the
device as it goes, and the 1.7B offload row's train phase was 0.35 s longer than the resident row's (BENCHMARKS.md,
"Step: rlrun vs verl"; this is the likely cause, to be confirmed by the next H200 run). In pieces, such a copy waits
for one piece at most."""


def streams_state(optimizer: MegatronOptimizer) -> bool:
    """Whether every part of ``optimizer`` steps with torch's Adam(W) on the device, whose state this module holds;
    Megatron's host Adam (``optimizer.cpu_offload``) keeps its state its own way."""
    adams = (torch.optim.Adam, torch.optim.AdamW)
    return all(type(getattr(part, "optimizer", None)) in adams for part in optimizer_parts(optimizer))


Key = tuple[int, str]
"""A state tensor's identity: the id of the parameter it belongs to and ``param`` (the optimizer's own weight) or its
state key."""


@dataclass
class _Entry:
    key: Key
    tensor: torch.Tensor | None  # None: a moment to create in its slot
    like: torch.Tensor  # what its slot is shaped like
    place: Callable[[torch.Tensor], None] | None = None  # how a created moment is set


@dataclass
class _Segment:
    """Buffers (one per dtype) allocated together, in the region, and their host copies."""

    device: dict[torch.dtype, torch.Tensor]
    host: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)


class FlatOptimizerState:
    """The state tensors of ``optimizer`` (its own weights, i.e. the fp32 main weights, not the model's; every state
    tensor that is not a scalar, i.e. the Adam moments) as views of buffers allocated inside ``region``, with pinned
    host copies made at :meth:`save_to_host` and copied back asynchronously by :meth:`load_from_host`.

    The buffers come in segments, each allocated when its tensors first appear: the main weights at construction,
    the moments at the first step (:meth:`stepping`), when torch's Adam would have created them, so the device holds
    them no earlier than before (the engine is awake while the trainer is built)."""

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
        self._slots: dict[Key, torch.Tensor] = {}
        self._segments: list[_Segment] = []
        self._stream: torch.cuda.Stream | None = None
        self._ready: torch.cuda.Event | None = None
        self.adopt()

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(buffer) for segment in self._segments for buffer in segment.device.values())

    def tensors(self) -> list[torch.Tensor]:
        """What the buffers hold."""
        return [entry.tensor for entry in self._entries(create=False) if entry.tensor is not None]

    def _entries(self, create: bool) -> list[_Entry]:
        """Every tensor the buffers hold or will; with ``create``, the moments of a parameter without Adam state too
        (its step count set now, the moments in their slots by :meth:`adopt`: created by torch and then copied, they
        would hold the device twice over at once)."""
        entries = []
        for part in optimizer_parts(self._optimizer):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    if not param.is_contiguous():
                        continue
                    if param.untyped_storage().data_ptr() not in self._model_storages:
                        entries.append(_Entry((id(param), "param"), param, param))
                    state = inner.state[param]
                    if not state and create:  # as torch's Adam creates it at the first step
                        state["step"] = adam_step(0, param, group)
                        for key in ADAM_MOMENTS:
                            place = functools.partial(state.__setitem__, key)
                            entries.append(_Entry((id(param), key), None, param, place))
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() > 0 and value.is_contiguous():
                            entries.append(_Entry((id(param), key), value, value))
        return entries

    def adopt(self, create: bool = False) -> None:
        """Place every entry in its slot (a copy, then the tensor's data pointed there); entries without one get a
        new segment. At construction, before every step (``create``) and before every save, since loading a
        checkpoint replaces the state with new tensors."""
        self.wait()
        entries = self._entries(create)
        new = [e for e in entries if not self._fits(e)]
        if new:
            self._allocate(new, new[0].like.device)
        for entry in entries:
            slot = self._slots[entry.key]
            if entry.tensor is None:
                assert entry.place is not None
                entry.place(slot.zero_())
            elif entry.tensor.data_ptr() != slot.data_ptr():
                slot.copy_(entry.tensor)
                entry.tensor.data = slot

    def _fits(self, entry: _Entry) -> bool:
        slot = self._slots.get(entry.key)
        return slot is not None and slot.dtype == entry.like.dtype and slot.shape == entry.like.shape

    def _allocate(self, entries: list[_Entry], device: torch.device) -> None:
        sizes: dict[torch.dtype, int] = {}
        for entry in entries:
            sizes[entry.like.dtype] = sizes.get(entry.like.dtype, 0) + entry.like.numel()
        with self._region():
            segment = _Segment({dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()})
        offsets = dict.fromkeys(sizes, 0)
        for entry in entries:
            dtype, numel = entry.like.dtype, entry.like.numel()
            start = offsets[dtype]
            self._slots[entry.key] = segment.device[dtype][start : start + numel].view(entry.like.shape)
            offsets[dtype] = start + numel
        self._segments.append(segment)

    def save_to_host(self) -> None:
        """Copy the state to its pinned host buffers (allocated at a segment's first save and kept: pinning anew each
        time costs more than the copy); returns when the copy is done, so the device buffers may be paused."""
        self.adopt()
        for segment in self._segments:
            for dtype, buffer in segment.device.items():
                if dtype not in segment.host:
                    host = segment.host[dtype] = torch.empty(buffer.shape, dtype=dtype)
                    if buffer.is_cuda:  # pinned in place: torch's pinned allocator rounds up to a power of two
                        _check(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), _nbytes(buffer), 0))
                segment.host[dtype].copy_(buffer)

    def load_from_host(self) -> None:
        """Start the copy back (on CUDA on a side stream, after the device buffers are mapped again); the next
        :meth:`wait` orders the current stream after it."""
        pairs = [(segment.device[d], host) for segment in self._segments for d, host in segment.host.items()]
        if not pairs:
            return
        if not pairs[0][0].is_cuda:
            for buffer, host in pairs:
                buffer.copy_(host)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for buffer, host in pairs:
                piece = max(COPY_PIECE_BYTES // buffer.element_size(), 1)
                for device_piece, host_piece in zip(buffer.split(piece), host.split(piece), strict=True):
                    device_piece.copy_(host_piece, non_blocking=True)
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

    def stepping(self, step: Callable[P, R]) -> Callable[P, R]:
        """The optimizer's ``step`` run after :meth:`wait`, with the Adam state of parameters that have none created
        in a new segment first (the first step)."""

        @functools.wraps(step)
        def after_placing(*args: P.args, **kwargs: P.kwargs) -> R:
            self.adopt(create=True)
            return step(*args, **kwargs)

        return after_placing


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check(error: object) -> None:
    if int(error) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"pinning the optimizer state's host copy failed: CUDA error {int(error)}")  # type: ignore[call-overload]
