"""The ZeroMQ RPC: round trips, remote errors, timeouts, peer death, endpoint choice and locality."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlrun.engine.rpc import (
    IPC_PATH_MAX_BYTES,
    RpcClient,
    RpcPeerDiedError,
    RpcRemoteError,
    RpcServer,
    RpcTimeoutError,
    RpcUnresponsiveError,
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


@pytest.mark.parametrize(
    "address, local",
    [
        ("ipc:///tmp/x.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.2:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.1.2.3:5555", False),
        ("inproc://x", False),
    ],
)
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


def test_calls_from_several_threads_are_multiplexed(tmp_path):
    """Quick calls are answered, one after another, while a slow one from another thread waits (the
    waiting thread owns the socket; the quick caller must not be starved of its replies)."""
    endpoint = choose_endpoint(tmp_path, "mux").address
    with serving(endpoint, _handlers()):
        client = RpcClient(endpoint, timeout_s=10, heartbeat_timeout_s=5)
        slow: dict = {}
        thread = threading.Thread(target=lambda: slow.update(result=client.call("sleep", seconds=1.5)))
        thread.start()
        time.sleep(0.2)
        start = time.monotonic()
        for i in range(10):
            assert client.call("echo", quick=i) == {"quick": i}
        assert time.monotonic() - start < 1.0 and "result" not in slow
        thread.join(timeout=10)
        assert slow["result"] == 1.5
        client.close()


def test_blocked_event_loop_misses_heartbeats_before_the_call_timeout(tmp_path):
    """A synchronous handler that blocks the server's loop stops its pings: the call fails after the
    heartbeat timeout (1 s here), long before its own 30 s timeout."""
    endpoint = choose_endpoint(tmp_path, "frozen").address
    with serving(endpoint, {"block": lambda seconds: time.sleep(seconds)}):
        client = RpcClient(endpoint, timeout_s=30, heartbeat_timeout_s=1.0, peer_detail=lambda: "state T")
        start = time.monotonic()
        with pytest.raises(
            RpcUnresponsiveError,
            match=r"block on .*: the worker has answered no heartbeat for "
            r"1\.\d s \(limit 1 s\).*; state T",
        ):
            client.call("block", seconds=4.0)
        assert time.monotonic() - start < 3.0
        client.close()


def test_heartbeats_keep_a_long_call_alive(tmp_path):
    """An awaiting handler leaves the loop free: pings are answered and the call outlives the
    heartbeat timeout."""
    endpoint = choose_endpoint(tmp_path, "alive").address
    with serving(endpoint, _handlers()):
        client = RpcClient(endpoint, timeout_s=30, heartbeat_timeout_s=0.5)
        assert client.call("sleep", seconds=2.0) == 2.0
        client.close()


def test_requests_without_the_token_are_refused(tmp_path):
    endpoint = choose_endpoint(tmp_path, "token").address
    with serving(endpoint, _handlers(), token=b"secret"):
        assert Path(endpoint[len("ipc://") :]).stat().st_mode & 0o777 == 0o600  # other users cannot connect
        stranger = RpcClient(endpoint, timeout_s=10, token=b"guess")
        with pytest.raises(RpcRemoteError, match="PermissionError: request token must match"):
            stranger.call("echo", x=1)
        stranger.close()
        owner = RpcClient(endpoint, timeout_s=10, token=b"secret")
        assert owner.call("echo", x=1) == {"x": 1}
        owner.close()


def test_close_does_not_hang_on_a_pump_lock_left_held_by_an_interrupt(tmp_path):
    """Ctrl-C between a pump's acquire and its ``try`` leaves the socket lock held by the interrupted
    thread itself; the shutdown that follows must still close the client instead of waiting forever."""
    client = RpcClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=1.0)
    assert client._socket_lock.acquire(blocking=False)  # what the interrupted pump left behind
    closer = threading.Thread(target=client.close, daemon=True)  # a hang fails the test instead of hanging it
    closer.start()
    closer.join(timeout=5.0)
    assert not closer.is_alive(), "close() waits forever for a lock nobody will release"
    assert client._socket.closed


def test_a_client_left_in_a_reference_cycle_is_collected_without_hanging(tmp_path):
    """The garbage collector finalizes a cycle's objects in any order; had the context no finalizer holding its
    socket, ``term`` would wait forever for the socket the collector had not closed yet."""
    import gc
    import subprocess
    import sys

    script = f"""
import gc
from rlrun.engine.rpc import RpcClient
gc.disable()
for _ in range(20):
    client = RpcClient("ipc://{tmp_path}/nobody", timeout_s=1)
    client.cycle = client  # forgotten without close(), only the collector can free it
    del client
gc.collect()
print("collected")
"""
    gc.collect()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr[-2000:]
