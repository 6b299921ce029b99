"""A small request/reply RPC over ZeroMQ, between a trainer rank and its engine worker.

Wire format: one msgpack frame per message (bytes allowed, ``use_bin_type``)::

    request  {"id": int, "method": str, "kwargs": {...}, "token": bytes}
    reply    {"id": int, "ok": true, "result": ...} | {"id": int, "ok": false, "error": str, "traceback": str}

The client is a DEALER and the server a ROUTER rather than REQ/REP: with request ids several calls
can be in flight at once (an ``abort`` while a ``generate`` runs) and a late reply to an abandoned
call is simply dropped. The server runs on an asyncio loop (the SGLang worker must share
``sglang.Engine``'s loop) and answers each request in its own task.

A waiting call fails, whichever comes first:

* **peer death** (``RpcPeerDiedError``): ``peer_status`` is polled every ``POLL_SLICE_S``;
* **no heartbeat** (``RpcUnresponsiveError``): while a call waits, the client pings every
  ``HEARTBEAT_INTERVAL_S`` (or a quarter of the timeout, if shorter) and the server answers pings on
  its event loop at once, even mid-generate.
  A stopped (SIGSTOP), frozen or loop-blocked worker misses them for ``heartbeat_timeout_s``;
* **call timeout** (``RpcTimeoutError``): the worker answers pings but not the call within ``timeout_s``.

Every request carries a token shared through the worker's environment, so only the process that
spawned the worker can drive it. Endpoints are ``ipc://`` sockets (mode 0600) in the run
directory; ``sockaddr_un`` holds at most 107 bytes of path, so a deep run directory falls back to a
short temp directory, and (if even that is too long) to loopback TCP. Methods that carry pickled
tensors (shared-memory fds / CUDA IPC handles, which only mean something on this host) are refused
on any endpoint that is not ipc or loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import ipaddress
import itertools
import logging
import os
import socket
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from rlrun.runtime import fault_points

log = logging.getLogger(__name__)

IPC_PATH_MAX_BYTES = 107
"""Longest ipc socket path: sizeof(sockaddr_un.sun_path) (108 on Linux) minus the NUL."""

POLL_SLICE_S = 0.1
"""How often a waiting call re-checks its deadlines and the peer process."""
PUMP_SLICE_S = 0.02
"""How long the socket owner waits for replies before sending requests queued meanwhile."""
HEARTBEAT_INTERVAL_S = 1.0
PING = "__ping__"
SERVER_DRAIN_S = 2.0
"""After ``stop``, how long the server lets running handlers finish and send their replies."""


class RpcError(RuntimeError):
    """Base class of every RPC failure."""


class RpcRemoteError(RpcError):
    """The method ran in the worker and raised; the message carries the worker's exception."""


class RpcTimeoutError(RpcError, TimeoutError):
    """No reply within the call's timeout while the peer process still looked alive."""


class RpcUnresponsiveError(RpcTimeoutError):
    """The peer process exists but has not answered a heartbeat for ``heartbeat_timeout_s``."""


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
            Path(self.address[len("ipc://") :]).unlink(missing_ok=True)
        if self.owned_dir is not None and self.owned_dir.exists():
            self.owned_dir.rmdir()


def choose_endpoint(run_dir: Path, name: str) -> Endpoint:
    """``ipc://<run_dir>/<name>.sock`` if the path fits in sockaddr_un, else a short fallback."""
    path = Path(run_dir).resolve() / f"{name}.sock"
    if len(os.fsencode(str(path))) <= IPC_PATH_MAX_BYTES:
        return Endpoint(f"ipc://{path}")
    reason = (
        f"ipc path {path} is {len(os.fsencode(str(path)))} bytes, over the {IPC_PATH_MAX_BYTES}-byte sockaddr_un limit"
    )
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
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
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


def _error_reply(request_id: int | None, exc: BaseException) -> bytes:
    return _pack(
        {"id": request_id, "ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    )


def _close_zmq(sock: zmq.Socket, context: zmq.Context) -> None:
    """Close ``sock``, then end ``context``: by ``close()``, or when its owner is collected without one. The
    finalizer holds both, so a forgotten client or server in a reference cycle cannot leave the garbage collector
    to finalize the context before its socket, where ``term`` would wait forever for a socket it no longer sees."""
    sock.close(linger=0)
    context.term()


class RpcServer:
    """Serves ``handlers[method](**kwargs)`` on a bound ROUTER socket, each request in its own task.

    A handler may be a plain function (it runs on the event loop, so it must be quick) or a
    coroutine function (slow work: it awaits a thread or another process). Pings are answered
    directly by the receive loop, so they measure whether that loop still runs.
    """

    def __init__(
        self,
        endpoint: str,
        handlers: Mapping[str, Callable[..., Any]],
        *,
        local_only: Collection[str] = (),
        token: bytes = b"",
    ) -> None:
        self.endpoint = endpoint
        self.handlers = dict(handlers)
        self.local_only = frozenset(local_only)
        self.token = token
        # Bound synchronously here (so the address is known before serving); ``serve`` wraps the
        # socket for asyncio on whichever loop runs it.
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._close = weakref.finalize(self, _close_zmq, self._socket, self._context)
        self._socket.bind(endpoint)
        self.bound_address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The address actually bound (a wildcard ``tcp://host:*`` resolves to its port)."""
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://") :], 0o600)  # only this user may connect

    async def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set (a handler may set it; its reply is still sent)."""
        sock = zmq.asyncio.Socket.from_socket(self._socket)
        tasks: set[asyncio.Task] = set()
        while not stop.is_set():
            if not await sock.poll(int(POLL_SLICE_S * 1000)):
                continue
            identity, frame = await sock.recv_multipart()
            request_id = None
            try:
                request = _unpack(frame)
                request_id = request["id"]
                if not hmac.compare_digest(request.get("token", b""), self.token):
                    raise PermissionError(
                        "request token must match the one the engine client gave this worker "
                        "because only the spawning trainer rank may drive it"
                    )
            except Exception as exc:
                await sock.send_multipart([identity, _error_reply(request_id, exc)])
                continue
            if request["method"] == PING:
                await sock.send_multipart([identity, _pack({"id": request_id, "ok": True, "result": None})])
                continue
            task = asyncio.create_task(self._answer(sock, identity, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=SERVER_DRAIN_S)
        for task in tasks:
            task.cancel()

    async def _answer(self, sock: zmq.asyncio.Socket, identity: bytes, request: dict[str, Any]) -> None:
        request_id, method = request["id"], request["method"]
        try:
            handler = self.handlers.get(method)
            if handler is None:
                raise ValueError(f"method ({method!r}) must be one of {sorted(self.handlers)}")
            if method in self.local_only and not is_local_endpoint(self.endpoint):
                raise PermissionError(
                    f"method ({method}) carries pickled tensor handles and must arrive over ipc:// or loopback "
                    f"tcp because handles only mean something on this host; {self.endpoint} is neither"
                )
            fault_points.reached(f"rpc.{method}")  # test-only (rlrun/runtime/fault_points.py)
            result = handler(**request.get("kwargs", {}))
            if inspect.isawaitable(result):
                result = await result
            reply = _pack({"id": request_id, "ok": True, "result": result})
        except Exception as exc:  # reported to the caller, which raises it as RpcRemoteError
            reply = _error_reply(request_id, exc)
        await sock.send_multipart([identity, reply])

    def close(self) -> None:
        self._close()


class RpcClient:
    """Calls methods on an :class:`RpcServer`; thread-safe, several calls may wait at once.

    ``peer_status`` (optional) returns None while the serving process is alive, or a description
    of its death (exit code, log tail); ``peer_detail`` (optional) describes a live but silent peer
    (its process state, log tail). ``heartbeat_timeout_s`` None disables the heartbeat check (a
    worker still loading its model cannot answer pings yet); see :meth:`arm_heartbeat`.

    Threads: zmq sockets are not thread-safe, so one waiting thread at a time owns the socket (the
    "pump": it sends everyone's queued requests and files everyone's replies) while the others wait
    on a condition. Nobody needs the socket to get its reply, so no caller can be starved of it.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float,
        token: bytes = b"",
        peer_status: Callable[[], str | None] | None = None,
        peer_detail: Callable[[], str] | None = None,
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.token = token
        self.peer_status = peer_status
        self.peer_detail = peer_detail
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._socket_lock = threading.Lock()  # held by the pumping thread
        self._state = threading.Condition()  # guards the fields below; notified when replies are filed
        self._ids = itertools.count()
        self._outbox: list[bytes] = []
        self._waiting: set[int] = set()
        self._replies: dict[int, dict[str, Any]] = {}
        self._last_heard = self._last_ping = 0.0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._close = weakref.finalize(self, _close_zmq, self._socket, self._context)
        self._socket.connect(endpoint)

    def arm_heartbeat(self, heartbeat_timeout_s: float | None) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s

    def call(self, method: str, *, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run ``method(**kwargs)`` in the server and return its result (or raise an :class:`RpcError`)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        with self._state:
            request_id = next(self._ids)
            self._waiting.add(request_id)
            self._last_heard = max(self._last_heard, start)  # silence before this call is not a missed beat
            self._outbox.append(_pack({"id": request_id, "method": method, "kwargs": kwargs, "token": self.token}))
        try:
            reply = self._wait_for(request_id, method, start, timeout_s)
        finally:
            with self._state:
                self._waiting.discard(request_id)
                self._replies.pop(request_id, None)
        if not reply["ok"]:
            raise RpcRemoteError(
                f"{method} on {self.endpoint} failed in the worker: {reply['error']}\n"
                f"worker traceback:\n{reply.get('traceback', '')}"
            )
        return reply["result"]

    def _wait_for(self, request_id: int, method: str, start: float, timeout_s: float) -> dict[str, Any]:
        while True:
            if self._socket_lock.acquire(blocking=False):
                try:
                    self._pump()
                finally:
                    self._socket_lock.release()
            else:
                with self._state:
                    if request_id not in self._replies:
                        self._state.wait(timeout=POLL_SLICE_S)
            with self._state:
                reply = self._replies.pop(request_id, None)
                silent_s = time.monotonic() - self._last_heard
            if reply is not None:
                return reply
            death = self.peer_status() if self.peer_status is not None else None
            if death is not None:
                raise RpcPeerDiedError(f"{method} on {self.endpoint} failed: {death}")
            if self.heartbeat_timeout_s is not None and silent_s > self.heartbeat_timeout_s:
                detail = self.peer_detail() if self.peer_detail is not None else ""
                raise RpcUnresponsiveError(
                    f"{method} on {self.endpoint}: the worker has answered no heartbeat for {silent_s:.1f} s "
                    f"(limit {self.heartbeat_timeout_s:g} s): it is stopped, frozen or its event loop is blocked"
                    f"{'; ' + detail if detail else ''}"
                )
            waited_s = time.monotonic() - start
            if waited_s > timeout_s:
                peer = (
                    (
                        "although the worker still answers heartbeats; it may be hung in the call or the call may "
                        "need longer (raise engine.request_timeout_s)"
                    )
                    if silent_s < waited_s
                    else ("and the worker has not answered anything since the call began")
                )
                raise RpcTimeoutError(f"{method} on {self.endpoint} got no reply within {timeout_s:g} s {peer}")

    def _pump(self) -> None:
        """(Socket owner only.) Send queued requests and a ping if one is due, wait up to one poll
        slice, and file every reply that arrived."""
        now = time.monotonic()
        timeout_s = self.heartbeat_timeout_s
        with self._state:
            outgoing, self._outbox = self._outbox, []
            if timeout_s is not None and now - self._last_ping >= min(HEARTBEAT_INTERVAL_S, timeout_s / 4):
                outgoing.append(_pack({"id": next(self._ids), "method": PING, "kwargs": {}, "token": self.token}))
                self._last_ping = now
        for frame in outgoing:
            self._socket.send(frame)
        if not self._socket.poll(int(PUMP_SLICE_S * 1000)):
            return
        received = []
        while self._socket.poll(0):
            received.append(_unpack(self._socket.recv()))
        with self._state:
            self._last_heard = time.monotonic()
            for reply in received:
                if reply.get("id") in self._waiting:
                    self._replies[reply["id"]] = reply
                # else: a pong, or a late reply to a call that already gave up
            self._state.notify_all()

    def close(self) -> None:
        """Close the socket. A pump holds the lock for one poll slice at most, so a lock still held after
        many slices belongs to a pump that will never release it: a KeyboardInterrupt that landed between
        its acquire and its ``try`` (then this very thread holds it, and waiting would hang Ctrl-C)."""
        acquired = self._socket_lock.acquire(timeout=20 * PUMP_SLICE_S)
        try:
            self._close()
        finally:
            if acquired:
                self._socket_lock.release()
