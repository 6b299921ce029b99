"""The optimizer's own state as views of a few device buffers, copied to the host and back by the offloader itself,
so that a wake's copy back runs on a side stream behind the forward and backward passes.

torch_memory_saver copies a paused region back with a synchronous ``cudaMemcpy`` on the legacy default stream,
which waits for every kernel queued before it and holds back every kernel after it. The optimizer's state (fp32
main weights and Adam moments, 12 of the 14 bytes a parameter that a sleep moves) is read by nothing before the
optimizer step, so its copy back need not hold back the forward pass: at 1.7B parameters it is 20 GB, a large part
of each wake at a host link's bandwidth (BENCHMARKS.md, "Step against peers"). Here it goes in pieces on a stream of
its own, queued by a thread of its own a few at a time (:class:`PacedCopy`, ``COPY_PIECE_BYTES``), and the step
waits for it on the device. The buffers live in the offloader's scratch region (paused and mapped again without a
copy); the model's weights, which the forward reads first, stay in the trainer region with the saver's synchronous
copy.

What is not in the buffers (the step counts, a tensor a later optimizer version adds) is wherever it was
allocated, outside every region (``Offloader.optimizer_region``): it stays on the device through a sleep, so
missing a tensor costs memory, never its contents.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, ParamSpec, Protocol, TypeVar

import torch

from rlrun.megatron.train import adam_step, optimizer_parts

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

P = ParamSpec("P")
R = TypeVar("R")
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
COPY_PIECE_BYTES = 32 << 20
"""The wake's copy back goes in pieces of this size, each well under a millisecond from the host. The train phase
copies each micro-batch's tensors to the device as it goes (``rlrun.runtime.host_to_device``), and such a copy waits
behind the host-to-device transfers queued before it on the copy engine, on any stream (the kernels after it with it).
With the whole state queued at the wake, even in pieces, the offload row's train phase was longer than the resident
one for the same kernels (BENCHMARKS.md, "Step against peers" appendix, the 1.7B runs against verl). So at most
``COPY_PIECES_IN_FLIGHT`` pieces are queued at a time: a micro-batch's copy waits for two pieces at most."""
COPY_PIECES_IN_FLIGHT = 2
"""How many pieces of the copy back are queued on the device at once. Two, not one: with one, the copy engine stands
idle from a piece's end until the copying thread has woken and taken the GIL from the train loop to queue the next;
with two, the next piece is queued while it does. More would only lengthen a micro-batch's wait (a piece's time
each)."""


def streams_state(optimizer: MegatronOptimizer) -> bool:
    """Whether every part of ``optimizer`` steps with torch's Adam(W) on the device, whose state this module holds;
    Megatron's host Adam (``optimizer.cpu_offload``) keeps its state its own way."""
    adams = (torch.optim.Adam, torch.optim.AdamW)
    return all(type(getattr(part, "optimizer", None)) in adams for part in optimizer_parts(optimizer))


class _Event(Protocol):
    def synchronize(self) -> None: ...


E = TypeVar("E", bound=_Event)


class PacedCopy(Generic[E]):
    """Runs ``pieces`` in order on a daemon thread, each a function that queues one piece of a copy on the device and
    returns an event recorded after it, with no more than ``in_flight`` of them queued and unfinished at once: before
    piece k it waits for piece k - ``in_flight`` to finish (``torch.cuda.Event.synchronize``, which lets go of the
    GIL, so the train loop runs meanwhile). ``setup`` runs first in the thread (its CUDA device and stream).
    :meth:`join` waits for the last piece to be queued."""

    def __init__(
        self, pieces: Sequence[Callable[[], E]], in_flight: int, setup: Callable[[], None] = lambda: None
    ) -> None:
        assert in_flight >= 1, in_flight
        self._setup = setup
        self._pieces = pieces
        self._in_flight = in_flight
        self.last: E | None = None
        """The event of the last piece queued so far; every piece queued before it is done when it is (the pieces
        go on one stream)."""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlrun-optimizer-state-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        queued: deque[E] = deque()
        try:
            self._setup()
            for piece in self._pieces:
                if len(queued) == self._in_flight:
                    queued.popleft().synchronize()
                queued.append(piece())
                self.last = queued[-1]
        except BaseException as error:  # re-raised by join, in the thread that waits
            self._error = error

    def running(self) -> bool:
        """Whether pieces remain to be queued."""
        return self._thread.is_alive()

    def join(self) -> E | None:
        """The last piece's event once every piece is queued (None without pieces); raises what a piece raised,
        after which :attr:`last` is the last piece queued before it."""
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("copying the optimizer state back to the device failed") from self._error
        return self.last


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
        self._copy: PacedCopy[torch.cuda.Event] | None = None  # the copy back since the last wait
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
        """Start the copy back (on CUDA on a side stream, after the device buffers are mapped again, and after any
        copy back still under way); the next :meth:`wait` orders the current stream after it."""
        self.wait()
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
        pieces = []
        for buffer, host in pairs:
            piece = max(COPY_PIECE_BYTES // buffer.element_size(), 1)
            for device_piece, host_piece in zip(buffer.split(piece), host.split(piece), strict=True):
                pieces.append(functools.partial(_copy_piece, self._stream, device_piece, host_piece))
        self._copy = PacedCopy(pieces, COPY_PIECES_IN_FLIGHT, functools.partial(_use_stream, self._stream))

    def wait(self) -> None:
        """Make the current stream wait for the copy back: the host waits until its last piece is queued (at most
        ``COPY_PIECES_IN_FLIGHT`` pieces before its end), the current stream until it is done. Raises what the
        copying thread raised, the current stream still waiting for what it had queued."""
        copy, self._copy = self._copy, None
        if copy is None:
            return
        try:
            copy.join()
        finally:
            if copy.last is not None:
                torch.cuda.current_stream().wait_event(copy.last)

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


def _use_stream(stream: torch.cuda.Stream) -> None:
    """Make ``stream`` and its device current in the copying thread, once and for good: a context manager would set
    the new thread's device back to its default, cuda:0, at its exit, and since CUDA 12 setting a device creates its
    context (device memory, on a GPU another rank may own)."""
    torch.cuda.set_device(stream.device)
    torch.cuda.set_stream(stream)


def _copy_piece(stream: torch.cuda.Stream, device: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event:
    """Queue ``host``'s copy to ``device`` on ``stream``, the copying thread's current stream (:func:`_use_stream`);
    the event after it blocks the thread that waits for it instead of spinning a core."""
    device.copy_(host, non_blocking=True)
    return stream.record_event(torch.cuda.Event(blocking=True))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _check(error: object) -> None:
    if int(error) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"pinning the optimizer state's host copy failed: CUDA error {int(error)}")  # type: ignore[call-overload]
