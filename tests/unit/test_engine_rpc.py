"""The ZeroMQ RPC: round trips, remote errors, timeouts, peer death, endpoint choice and locality."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from rlrun.engine.rpc import (
    IPC_PATH_MAX_BYTES,
    RpcClient,
    RpcPeerDiedError,
    RpcRemoteError,
    RpcServer,
    RpcTimeoutError,
    choose_endpoint,
    is_local_endpoint,
)


def _handlers() -> dict:
    def fail(message: str) -> None:
        raise ValueError(message)

    async def sleep(seconds: float) -> float:
        await asyncio.sleep(seconds)
        return seconds

    return {"echo": lambda **kw: kw, "fail": fail, "sleep": sleep, "unpackable": lambda: object()}


@contextmanager
def serving(endpoint: str, handlers: dict, **kwargs) -> Iterator[RpcServer]:
    server = RpcServer(endpoint, handlers, **kwargs)
    stop = threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(server.serve(stop),), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_round_trip_keeps_bytes_and_nested_values(tmp_path):
    endpoint = choose_endpoint(tmp_path, "rt").address
    with serving(endpoint, _handlers()):
        client = RpcClient(endpoint, timeout_s=10)
        payload = {"blob": bytes(range(256)) * 100, "ids": [[1, 2], [3]], "params": {"t": 0.5, "seed": None}}
        assert client.call("echo", **payload) == payload
        client.close()


def test_remote_exception_names_method_endpoint_and_error(tmp_path):
    endpoint = choose_endpoint(tmp_path, "err").address
    with serving(endpoint, _handlers()):
        client = RpcClient(endpoint, timeout_s=10)
        with pytest.raises(RpcRemoteError, match=rf"fail on {endpoint} failed in the worker: ValueError: boom"):
            client.call("fail", message="boom")
        with pytest.raises(RpcRemoteError, match=r"method \('nope'\) must be one of \['echo', 'fail', 'sleep', "):
            client.call("nope")
        with pytest.raises(RpcRemoteError, match="TypeError: can not serialize 'object' object"):
            client.call("unpackable")  # a result msgpack cannot carry is an error reply, not a dead server
        assert client.call("echo", alive=True) == {"alive": True}
        client.close()


def test_timeout_names_method_and_endpoint_and_drops_the_late_reply(tmp_path):
    endpoint = choose_endpoint(tmp_path, "slow").address
    with serving(endpoint, _handlers()):
        client = RpcClient(endpoint, timeout_s=10)
        start = time.monotonic()
        with pytest.raises(RpcTimeoutError, match=rf"sleep on {endpoint} got no reply within 0.3 s"):
            client.call("sleep", seconds=1.0, timeout_s=0.3)
        assert time.monotonic() - start < 1.0
        # The late reply to "sleep" arrives first and must be skipped, not returned for this call.
        assert client.call("echo", x=1) == {"x": 1}
        client.close()


def test_dead_peer_fails_the_call_at_once_with_its_description(tmp_path):
    endpoint = choose_endpoint(tmp_path, "nobody").address  # nothing ever binds it
    client = RpcClient(endpoint, timeout_s=30, peer_status=lambda: "worker exited with code -9")
    start = time.monotonic()
    with pytest.raises(RpcPeerDiedError, match=r"health on .* failed: worker exited with code -9"):
        client.call("health")
    assert time.monotonic() - start < 2.0
    client.close()


def test_long_run_dir_falls_back_to_a_short_ipc_path(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    endpoint = choose_endpoint(deep, "engine-0")
    assert endpoint.address.startswith("ipc://") and str(deep) not in endpoint.address
    assert len(endpoint.address) - len("ipc://") <= IPC_PATH_MAX_BYTES
    assert "sockaddr_un" in endpoint.fallback_reason and endpoint.owned_dir is not None
    with serving(endpoint.address, _handlers()):
        client = RpcClient(endpoint.address, timeout_s=10)
        assert client.call("echo", ok=True) == {"ok": True}
        client.close()
    endpoint.cleanup()
    assert not endpoint.owned_dir.exists()


@pytest.mark.parametrize("address, local", [
    ("ipc:///tmp/x.sock", True), ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.2:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://localhost:5555", True), ("tcp://0.0.0.0:5555", False),
    ("tcp://*:5555", False), ("tcp://10.1.2.3:5555", False), ("inproc://x", False),
])
def test_is_local_endpoint(address, local):
    assert is_local_endpoint(address) is local


def test_payload_methods_are_refused_on_a_non_local_endpoint():
    with serving("tcp://0.0.0.0:*", _handlers(), local_only={"echo"}) as server:
        port = server.bound_address.rsplit(":", 1)[1]
        client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_s=10)
        with pytest.raises(RpcRemoteError, match=r"PermissionError: method \(echo\) carries pickled tensor handles"):
            client.call("echo", blob=b"x")
        assert client.call("sleep", seconds=0) == 0  # other methods still work
        client.close()
