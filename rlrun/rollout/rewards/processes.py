"""Reward calls in processes that can be killed: ``rollout.reward_timeout_s`` scores a hung sample 0 and the job
goes on.

Python cannot stop a function that sleeps, spins or waits on a socket without a timeout, but it can kill the
process it runs in. With a limit set, each rank keeps up to ``rollout.reward_processes`` worker processes
(``python -m rlrun.rollout.rewards.worker``, started on first use, reused across steps); a call is one
pickled ``(function, sample or group)`` request on the worker's stdin and one pickled reply. A call past the
limit kills its worker (a fresh one is started for the next call) and raises :class:`RewardTimeoutError`, which
scores the sample (or group) 0 and counts it in ``rollout/reward_errors``.

Functions cross by reference: a module function by its import path; one loaded from a file
(``path/to/file.py:function``, or a script's ``__main__``) by its file and name, loaded again in the worker
(:func:`function_from_file`). Workers end with their rank (they watch it) and are killed at its exit.
"""

from __future__ import annotations

import atexit
import io
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import types
from typing import Any

_HEADER = struct.Struct("<Q")
READY = b"ready"
"""A worker's first message: it has imported what it needs and reads requests."""


class RewardTimeoutError(TimeoutError):
    """A reward call ran past ``rollout.reward_timeout_s``; its process was killed."""


class RewardProcessError(RuntimeError):
    """A reward process ended without answering (it crashed or was killed from outside)."""


class RewardRaised(Exception):
    """The reward function raised in its process; the message is its ``"Type: message"``."""


def function_from_file(path: str, qualname: str) -> Any:
    """The function ``qualname`` of the file ``path``, imported as rlrun imports hook files (run in the worker)."""
    from rlrun.runtime.hooks import resolve_hook

    return resolve_hook(f"{path}:{qualname}", num_args=None, allow_async=True)


class _Pickler(pickle.Pickler):
    """Pickles functions of modules a fresh process cannot import by name (hook files, ``__main__``) by file."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, types.FunctionType):
            return NotImplemented
        module = sys.modules.get(obj.__module__)
        importable = obj.__module__ != "__main__" and not obj.__module__.startswith("rlrun_user_hook_")
        if importable or getattr(module, "__file__", None) is None:
            return NotImplemented
        return function_from_file, (os.path.abspath(module.__file__), obj.__qualname__)


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def write_message(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream) -> bytes | None:
    """One length-prefixed message, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    return stream.read(_HEADER.unpack(header)[0])


STARTUP_S = 300.0
"""Longest a reward process may take to start (imports on a busy machine); not counted against a call."""


class _Worker:
    """One reward process and its pipes; constructed once it has said it is ready, so a call's time limit
    counts the call only."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlrun.rollout.rewards.worker", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        ready, _, _ = select.select([self.process.stdout], [], [], STARTUP_S)
        if not ready or read_message(self.process.stdout) != READY:
            self.kill()
            raise RewardProcessError(f"a reward process did not start within {STARTUP_S:g} s")

    def call(self, request: bytes, timeout_s: float) -> Any:
        write_message(self.process.stdin, request)
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        if not ready:
            self.kill()
            raise RewardTimeoutError(
                f"no reward within rollout.reward_timeout_s ({timeout_s:g} s); its process (pid "
                f"{self.process.pid}) was killed"
            )
        reply = read_message(self.process.stdout)
        if reply is None:
            code = self.process.wait()
            raise RewardProcessError(f"the reward process (pid {self.process.pid}) ended with exit code {code}")
        ok, value = pickle.loads(reply)
        if not ok:
            raise RewardRaised(value)
        return value

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


class RewardProcesses:
    """The rank's reward workers; :meth:`call` is thread-safe (scoring calls it from a thread per unit)."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def call(self, fn: Any, argument: Any, timeout_s: float) -> Any:
        """``fn(argument)`` in a worker (awaited there when it is a coroutine); raises
        :class:`RewardTimeoutError` after ``timeout_s`` seconds, or what the function raised."""
        request = dumps((fn, argument))
        worker = self._acquire()
        try:
            return worker.call(request, timeout_s)
        finally:
            with self._lock:
                if worker.alive:
                    self._idle.append(worker)
                else:
                    self._all.remove(worker)

    def _acquire(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        worker = _Worker()
        with self._lock:
            self._all.append(worker)
        return worker

    def close(self) -> None:
        """Kill every worker (each one this process started, by its pid)."""
        with self._lock:
            workers, self._all, self._idle = self._all, [], []
        for worker in workers:
            worker.kill()


_PROCESSES: RewardProcesses | None = None


def reward_processes() -> RewardProcesses:
    """This process's reward workers, created on first use and killed at exit."""
    global _PROCESSES
    if _PROCESSES is None:
        _PROCESSES = RewardProcesses()
        atexit.register(_PROCESSES.close)
    return _PROCESSES
