"""The optimizer state's host copy (rlrun/trainer/optimizer_state.py) on CPU: the paced copy's feeder against fake
pieces and events (no more than ``in_flight`` queued and unfinished, a piece's error raised where the copy is waited
for), and a FlatOptimizerState's steps through save / wipe / load against a plain AdamW. The CUDA copy itself:
tests/gpu/test_offload_gpu.py."""

from __future__ import annotations

import contextlib
import threading
import time
import types

import pytest
import torch

from adamw_twins import assert_same_as_plain_adamw
from rlrun.trainer.optimizer_state import FlatOptimizerState, PacedCopy

TIMEOUT_S = 10.0


class FakeDevice:
    """Pieces that log their queuing; a piece's event's ``synchronize`` logs it and blocks until the test lets the
    piece finish (all finish at once unless ``held``)."""

    def __init__(self, held: bool = False) -> None:
        self.log: list[tuple[str, int]] = []
        self.finished: dict[int, threading.Event] = {}
        self.held = held

    def piece(self, index: int, error: Exception | None = None):
        self.finished[index] = threading.Event()
        if not self.held:
            self.finished[index].set()

        def queue() -> FakeEvent:
            if error is not None:
                raise error
            self.log.append(("queue", index))
            return FakeEvent(self, index)

        return queue

    def queued(self) -> list[int]:
        return [i for what, i in self.log if what == "queue"]


class FakeEvent:
    def __init__(self, device: FakeDevice, index: int) -> None:
        self.device, self.index = device, index

    def synchronize(self) -> None:
        assert self.device.finished[self.index].wait(TIMEOUT_S), f"piece {self.index} never finished"
        self.device.log.append(("synced", self.index))


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.mark.parametrize("num_pieces", [0, 1, 2, 7])
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_a_piece_is_queued_only_once_the_one_in_flight_before_it_finished(num_pieces, in_flight):
    device = FakeDevice()
    copy = PacedCopy([device.piece(i) for i in range(num_pieces)], in_flight)
    last = copy.join()
    assert device.queued() == list(range(num_pieces))
    assert (last is None) if num_pieces == 0 else (last.index == num_pieces - 1)
    unfinished = 0
    for what, index in device.log:
        if what == "queue":
            unfinished += 1
            assert index < in_flight or ("synced", index - in_flight) in device.log[: device.log.index((what, index))]
        else:
            unfinished -= 1
        assert unfinished <= in_flight, device.log
    # the last in_flight pieces are left to the device: the waiter's stream waits for the last event instead
    assert [i for what, i in device.log if what == "synced"] == list(range(max(num_pieces - in_flight, 0)))


def test_the_thread_holds_back_the_next_piece_until_the_oldest_finishes():
    device = FakeDevice(held=True)
    copy = PacedCopy([device.piece(i) for i in range(5)], in_flight=2)
    _until(lambda: len(device.queued()) == 2, "the first two pieces were not queued")
    time.sleep(0.05)
    assert device.queued() == [0, 1] and copy.running()
    device.finished[0].set()
    _until(lambda: len(device.queued()) == 3, "piece 2 was not queued once piece 0 finished")
    time.sleep(0.05)
    assert device.queued() == [0, 1, 2] and copy.running()
    for finished in device.finished.values():
        finished.set()
    assert copy.join().index == 4
    assert not copy.running()


def test_an_error_in_a_piece_is_raised_by_join_with_its_cause_and_stops_the_copy():
    device = FakeDevice()
    pieces = [device.piece(i, ValueError("no such piece") if i == 3 else None) for i in range(6)]
    copy = PacedCopy(pieces, in_flight=2)
    with pytest.raises(RuntimeError, match="copying the optimizer state back") as raised:
        copy.join()
    assert isinstance(raised.value.__cause__, ValueError)
    assert device.queued() == [0, 1, 2]
    assert copy.last is not None and copy.last.index == 2  # what the waiter's stream must still wait for


def test_an_error_in_the_setup_is_raised_by_join_and_queues_nothing():
    device = FakeDevice()

    def setup() -> None:
        raise OSError("no device")

    copy = PacedCopy([device.piece(0)], in_flight=2, setup=setup)
    with pytest.raises(RuntimeError) as raised:
        copy.join()
    assert isinstance(raised.value.__cause__, OSError) and copy.last is None and device.queued() == []


def test_flat_state_steps_through_its_host_copy_as_a_plain_adamw_on_cpu():
    """Three AdamW steps with the state (the parameters, which no model owns here, and both moments) in a
    FlatOptimizerState whose buffers are wiped (NaN) after every save, reloaded, and a second load before the wait,
    equal three steps of a plain AdamW bit for bit."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(37, 11), (300,), (5, 4, 3)]
    params = [torch.randn(shape, generator=gen) for shape in shapes]
    twins = [p.clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1)
    state = FlatOptimizerState(types.SimpleNamespace(optimizer=optimizer), [], contextlib.nullcontext)
    step = state.stepping(optimizer.step)
    for _ in range(3):
        for param, twin in zip(params, twins, strict=True):
            param.grad = torch.randn(param.shape, generator=gen)
            twin.grad = param.grad.clone()
        step()
        reference.step()
        state.save_to_host()
        for tensor in state.tensors():
            tensor.fill_(float("nan"))
        state.load_from_host()
        state.load_from_host()
        state.wait()
    assert_same_as_plain_adamw(state, optimizer, reference)
