"""A small request/reply RPC over ZeroMQ, between a trainer rank and its engine worker.

Wire format: one msgpack frame per message (bytes allowed, ``use_bin_type``)::

    request  {"id": int, "method": str, "kwargs": {...}}
    reply    {"id": int, "ok": true, "result": ...} | {"id": int, "ok": false, "error": str, "traceback": str}

The client is a DEALER and the server a ROUTER rather than REQ/REP, because a REQ socket is stuck
after a timed-out request; with request ids a late reply to an abandoned call is simply dropped.

Endpoints are ``ipc://`` sockets in the run directory. ``sockaddr_un`` holds at most 107 bytes of
path, so a deep run directory falls back to a short temp directory, and (if even that is too long)
to loopback TCP. Methods that carry pickled tensors (shared-memory fds / CUDA IPC handles, which
only mean something on the same host) are refused on any endpoint that is not ipc or loopback.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
import os
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import msgpack
import zmq

log = logging.getLogger(__name__)

IPC_PATH_MAX_BYTES = 107
"""Longest ipc socket path: sizeof(sockaddr_un.sun_path) (108 on Linux) minus the NUL."""

_POLL_SLICE_S = 0.2


class RpcError(RuntimeError):
    """Base class of every RPC failure."""


class RpcRemoteError(RpcError):
    """The method ran in the worker and raised; the message carries the worker's exception."""


class RpcTimeoutError(RpcError, TimeoutError):
    """No reply within the call's timeout while the peer process still looked alive."""


class RpcPeerDiedError(RpcError):
    """The peer process exited before replying."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A bindable address plus what to clean up after it and why it is not the preferred one."""

    address: str
    owned_dir: Path | None = None
    """A temp directory created for the socket, removed by ``cleanup``."""
    fallback_reason: str | None = None

    def cleanup(self) -> None:
        """Remove the ipc socket file (and the temp directory it was put in, if any)."""
        if self.address.startswith("ipc://"):
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)
        if self.owned_dir is not None and self.owned_dir.exists():
            self.owned_dir.rmdir()


def choose_endpoint(run_dir: Path, name: str) -> Endpoint:
    """``ipc://<run_dir>/<name>.sock`` if the path fits in sockaddr_un, else a short fallback."""
    path = Path(run_dir).resolve() / f"{name}.sock"
    if len(os.fsencode(str(path))) <= IPC_PATH_MAX_BYTES:
        return Endpoint(f"ipc://{path}")
    reason = (f"ipc path {path} is {len(os.fsencode(str(path)))} bytes, over the {IPC_PATH_MAX_BYTES}-byte "
              "sockaddr_un limit")
    short_dir = Path(tempfile.mkdtemp(prefix="rlrun-"))
    short_path = short_dir / f"{name}.sock"
    if len(os.fsencode(str(short_path))) <= IPC_PATH_MAX_BYTES:
        log.warning("%s; using %s instead", reason, short_path)
        return Endpoint(f"ipc://{short_path}", owned_dir=short_dir, fallback_reason=reason)
    short_dir.rmdir()
    # Hazard: the port is free now but could be taken before the worker binds it; binding then
    # fails loudly in the worker, which the client reports with the worker's log.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reason += f", and so is the temp directory {short_dir}"
    log.warning("%s; using loopback tcp port %d instead", reason, port)
    return Endpoint(f"tcp://127.0.0.1:{port}", fallback_reason=reason)


def is_local_endpoint(address: str) -> bool:
    """True for ``ipc://`` and for TCP on a loopback address (127.0.0.0/8, ::1, localhost)."""
    if address.startswith("ipc://"):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _pack(message: Mapping[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def _unpack(frame: bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame, raw=False)


class RpcServer:
    """Serves ``handlers[method](**kwargs)`` one request at a time on a bound ROUTER socket."""

    def __init__(self, endpoint: str, handlers: Mapping[str, Callable[..., Any]],
                 *, local_only: Collection[str] = ()) -> None:
        self.endpoint = endpoint
        self.handlers = dict(handlers)
        self.local_only = frozenset(local_only)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.bound_address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The address actually bound (a wildcard ``tcp://host:*`` resolves to its port)."""

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set (a handler may set it; its reply is still sent)."""
        while not stop.is_set():
            if not self._socket.poll(int(_POLL_SLICE_S * 1000)):
                continue
            identity, frame = self._socket.recv_multipart()
            self._socket.send_multipart([identity, self._answer(frame)])

    def _answer(self, frame: bytes) -> bytes:
        request_id = None
        try:
            request = _unpack(frame)
            request_id, method = request["id"], request["method"]
            handler = self.handlers.get(method)
            if handler is None:
                raise ValueError(f"method ({method!r}) must be one of {sorted(self.handlers)}")
            if method in self.local_only and not is_local_endpoint(self.endpoint):
                raise PermissionError(
                    f"method ({method}) carries pickled tensor handles and must arrive over ipc:// or loopback "
                    f"tcp because handles only mean something on this host; {self.endpoint} is neither")
            return _pack({"id": request_id, "ok": True, "result": handler(**request.get("kwargs", {}))})
        except Exception as exc:  # reported to the caller, which raises it as RpcRemoteError
            return _pack({"id": request_id, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()})

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()


class RpcClient:
    """Calls methods on an :class:`RpcServer`, with a timeout per call.

    ``peer_status`` (optional) is polled while waiting: it returns None while the serving process is
    alive, or a description of its death (exit code, log tail), which fails the call at once instead
    of waiting out the timeout.
    """

    def __init__(self, endpoint: str, *, timeout_s: float,
                 peer_status: Callable[[], str | None] | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.peer_status = peer_status
        self._ids = itertools.count()
        self._lock = threading.Lock()  # zmq sockets are not thread-safe (atexit may call from another thread)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def call(self, method: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``method(**kwargs)`` in the server and return its result (or raise an :class:`RpcError`)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            request_id = next(self._ids)
            self._socket.send(_pack({"id": request_id, "method": method, "kwargs": kwargs}))
            reply = self._wait_for(request_id, method, timeout_s)
        if not reply["ok"]:
            raise RpcRemoteError(f"{method} on {self.endpoint} failed in the worker: {reply['error']}\n"
                                 f"worker traceback:\n{reply.get('traceback', '')}")
        return reply["result"]

    def _wait_for(self, request_id: int, method: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise RpcTimeoutError(
                    f"{method} on {self.endpoint} got no reply within {timeout_s:g} s and the worker is still "
                    "running; it may be hung or the call may need longer (raise engine.request_timeout_s)")
            if self._socket.poll(int(min(remaining_s, _POLL_SLICE_S) * 1000) + 1):
                reply = _unpack(self._socket.recv())
                if reply.get("id") == request_id:
                    return reply
                continue  # a late reply to an earlier, timed-out call
            death = self.peer_status() if self.peer_status is not None else None
            if death is not None:
                raise RpcPeerDiedError(f"{method} on {self.endpoint} failed: {death}")

    def close(self) -> None:
        with self._lock:
            self._socket.close(linger=0)
            self._context.term()
