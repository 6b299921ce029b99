"""The trainer rank's handle on its engine worker: spawn it, call the contract, shut it down.

Usage::

    with EngineClient.spawn(BackendSpec("embedded", hf_dir, seed), run_dir=run_dir, rank=rank) as engine:
        results = engine.generate(prompt_ids, {"max_new_tokens": 8, "n": 8, "temperature": 1.0})
        engine.update_weights(hf_named_tensors, weight_version="1", bucket_bytes=512 * 2**20)

The worker is a child process (``python -m rlrun.engine.worker``) in its own process group, with a
clean environment (no torchrun rendezvous variables, one thread), its output in
``<run_dir>/engine-<rank>.log``, and it dies with this process (parent-death signal plus a watchdog
thread; :meth:`EngineClient.shutdown` runs on exit and kills the whole group if the worker does not
stop). Every call fails loudly, within seconds for a dead or frozen worker: with the engine's
message when it refuses, with the worker's exit code and log tail when it died, after
``heartbeat_timeout_s`` without a heartbeat (stopped or frozen), or after ``request_timeout_s``
when it answers heartbeats but never the call. Calls may come from several threads at once (an
``abort`` while another thread waits in ``generate``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rlrun.engine.payload import iter_buckets, serialize_for_tp_ranks, tensor_checksum
from rlrun.engine.registry import BackendSpec
from rlrun.engine.rpc import Endpoint, RpcClient, RpcError, choose_endpoint
from rlrun.engine.types import EngineStatus, GenResult, OpResult
from rlrun.engine.worker import AUTHKEY_ENV, TOKEN_ENV
from rlrun.runtime.deaths import WatchedProcess

log = logging.getLogger(__name__)

# torchrun's rendezvous variables: a worker that inherits them could join the trainer's process group
# by accident. PYTORCH_CUDA_ALLOC_CONF is dropped as slime does for SGLang (it breaks its memory saver).
_DROPPED_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTORCH_CUDA_ALLOC_CONF",
)
SHUTDOWN_REPLY_S = 2.0
"""The shutdown reply comes at once from a healthy worker (it is answered on the event loop)."""
SHUTDOWN_GRACE_S = 10.0
"""Time for the worker to tear its backend down (SGLang kills its scheduler processes) and exit."""
LOG_TAIL_LINES = 20
PROCESS_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O",
    "T": "stopped by a signal",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


class EngineOpError(RuntimeError):
    """The engine answered ``success=False``; the message is the engine's."""


def _worker_env(token: bytes, extra_env: Mapping[str, str]) -> dict[str, str]:
    """This process's environment minus torchrun's, plus ``extra_env``, the secrets and one thread.
    CUDA_VISIBLE_DEVICES is inherited unchanged: trainer and engine must number GPUs alike."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV and not k.startswith("TORCHELASTIC_")}
    env.update(extra_env)
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding rlrun/ (engine/client.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env[AUTHKEY_ENV] = multiprocessing.current_process().authkey.hex()
    env[TOKEN_ENV] = token.hex()
    return env


def _tail(path: Path, num_lines: int) -> str:
    if not path.exists():
        return "(no log file)"
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 16384))
        lines = f.read().decode(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:]) or "(empty log)"


class EngineClient:
    """RPC stub for one engine worker process; see the module docstring."""

    def __init__(
        self,
        *,
        rank: int,
        endpoint: Endpoint,
        process: subprocess.Popen,
        log_path: Path,
        request_timeout_s: float,
        token: bytes,
        spec: BackendSpec,
    ) -> None:
        self.rank = rank
        self.spec = spec
        self.tp_size = spec.tp_size
        """The engine's TP size: every weight bucket goes out as one payload per engine TP rank."""
        self.dtype = spec.dtype
        """The engine's weight dtype, which synced tensors are cast to (and verified in)."""
        self.endpoint = endpoint
        self.process = process
        self.log_path = log_path
        self.watched = WatchedProcess(process, log_path)
        """The worker with its OOM-kill counters at start (a SIGKILL after they rose is the OOM killer's); the
        watchdog watches this same record."""
        self.rpc = RpcClient(
            endpoint.address,
            timeout_s=request_timeout_s,
            token=token,
            peer_status=self._death_note,
            peer_detail=self._process_detail,
        )
        self._closed = False
        atexit.register(self.shutdown)

    @classmethod
    def spawn(
        cls,
        spec: BackendSpec,
        *,
        run_dir: Path,
        rank: int,
        startup_timeout_s: float = 300,
        request_timeout_s: float = 600,
        heartbeat_timeout_s: float = 8.0,
        extra_env: Mapping[str, str] | None = None,
        name: str = "engine",
    ) -> EngineClient:
        """Start a worker for ``spec`` and wait (up to ``startup_timeout_s``) until it answers ``health``.

        ``extra_env`` adds variables to the worker's environment only (SGLANG_* switches, say), over the spec's
        ``worker_env``; ``name`` prefixes its endpoint and log file, ``{name}-{rank}`` (a second worker per rank
        needs its own).
        """
        if spec.tp_size > 1 and not spec.traits.shards_over_tp:
            raise ValueError(
                f"engine tp_size ({spec.tp_size}) must be 1 for backend {spec.backend} because it does not "
                "shard over TP (one engine serves its group); spawn it with tp_size 1"
            )
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        endpoint = choose_endpoint(run_dir, f"{name}-{rank}")
        log_path = run_dir / f"{name}-{rank}.log"
        token = secrets.token_bytes(16)
        command = [
            sys.executable,
            "-m",
            "rlrun.engine.worker",
            "--endpoint",
            endpoint.address,
            "--parent-pid",
            str(os.getpid()),
            "--spec",
            spec.to_json(),
        ]
        with log_path.open("wb") as log_file:
            # Own process group: the client can kill the worker with everything it started, and a
            # terminal's Ctrl-C reaches only the trainer, which then shuts the worker down.
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=_worker_env(token, {**spec.worker_env, **(extra_env or {})}),
                process_group=0,
            )
        client = cls(
            rank=rank,
            endpoint=endpoint,
            process=process,
            log_path=log_path,
            request_timeout_s=request_timeout_s,
            token=token,
            spec=spec,
        )
        try:
            client.rpc.call("health", timeout_s=startup_timeout_s)
        except BaseException as exc:
            client.shutdown()
            if not isinstance(exc, RpcError):
                raise
            raise type(exc)(
                f"engine worker for rank {rank} ({spec.backend} backend, model {spec.model_path}) did not start: {exc}"
            ) from None
        client.rpc.arm_heartbeat(heartbeat_timeout_s)  # from now on the worker's event loop answers pings
        log.info("engine worker for rank %d up (pid %d, %s)", rank, process.pid, endpoint.address)
        return client

    def _death_note(self) -> str | None:
        """None while the worker runs, else its exit code and the end of its log."""
        how = self.watched.exit_note()
        if how is None:
            return None
        return (
            f"engine worker for rank {self.rank} (pid {self.process.pid}) {how}; "
            f"last lines of {self.log_path}:\n{_tail(self.log_path, LOG_TAIL_LINES)}"
        )

    def _process_detail(self) -> str:
        """How a live but silent worker looks from outside: its process state and the end of its log."""
        try:
            state = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
            state = f"{state} ({PROCESS_STATES.get(state, 'see man proc')})"
        except OSError:
            state = "unknown"
        return (
            f"engine worker for rank {self.rank} (pid {self.process.pid}) is in process state {state}; "
            f"last lines of {self.log_path}:\n{_tail(self.log_path, LOG_TAIL_LINES)}"
        )

    # ---- the contract ------------------------------------------------------------------------------

    def health(self) -> EngineStatus:
        return self.rpc.call("health")

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = True,
        rids: list[str] | None = None,
    ) -> list[GenResult]:
        return self.rpc.call(
            "generate", input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob, rids=rids
        )

    def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float = 1.0
    ) -> list[list[float]]:
        """Each sequence's log-probs of its tokens from ``starts[i]`` on, given the tokens before them:
        ``log_softmax(logits / temperature)``, fp32, whole vocabulary (docs/engine-contract.md)."""
        return self.rpc.call("score_tokens", input_ids=input_ids, starts=starts, temperature=temperature)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.rpc.call("abort", rid=rid, abort_all=abort_all)

    def pause_generation(self, mode: str = "abort") -> None:
        self.rpc.call("pause_generation", mode=mode)

    def continue_generation(self) -> None:
        self.rpc.call("continue_generation")

    def flush_cache(self) -> OpResult:
        return self.rpc.call("flush_cache")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.rpc.call("release_memory_occupation", tags=tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.rpc.call("resume_memory_occupation", tags=tags)

    def begin_weight_update(self) -> OpResult:
        return self.rpc.call("begin_weight_update")

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[bytes],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> OpResult:
        return self.rpc.call(
            "update_weights_from_tensor",
            serialized_named_tensors=serialized_named_tensors,
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
        )

    def end_weight_update(self) -> OpResult:
        return self.rpc.call("end_weight_update")

    def get_weight_version(self) -> str:
        return self.rpc.call("get_weight_version")

    def weight_checksums(self) -> dict[str, str]:
        return self.rpc.call("weight_checksums")

    # ---- conveniences ------------------------------------------------------------------------------

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        weight_version: str,
        bucket_bytes: int,
        verify: bool = False,
        serialize: Callable[[list[tuple[str, torch.Tensor]]], list[bytes]] | None = None,
    ) -> dict[str, Any]:
        """Push full HF-named tensors in flattened buckets inside one update session.

        Each bucket call carries ``weight_version`` (as slime does), so the version flips with the
        first bucket; nothing generates until the session ends. Exporting and packing bucket k+1
        overlaps the engine's load of bucket k (one call in flight at a time, so the engine still
        loads in order; at most two buckets are alive). The session is closed even when a bucket
        fails, so the next sync can begin again; when this returns, the engine has finished its
        copies (the embedded engine answers ``end_weight_update`` after them). ``verify`` (debug)
        hashes every tensor as sent (cast to the engine's dtype) and checks the engine holds exactly
        those bytes afterwards. ``serialize`` turns a bucket into the engine TP ranks' payloads
        (default: one flat buffer on this process's device for every TP rank; an engine group whose
        TP ranks sit on the group's GPUs passes payloads gathered from each rank's own GPU instead).
        Returns {num_buckets, num_bytes, seconds}.
        """
        if serialize is None:
            serialize = functools.partial(serialize_for_tp_ranks, tp_size=self.tp_size)
        start = time.perf_counter()
        num_buckets = num_bytes = 0
        sent: dict[str, str] = {}
        self._expect_success("begin_weight_update", self.begin_weight_update())
        in_flight: Future | None = None
        try:
            with ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.rank}-sync") as sender:
                for bucket in iter_buckets(named_tensors, bucket_bytes):
                    # A fresh payload per bucket; its memory is released once the worker has loaded it.
                    payloads = serialize(bucket)
                    if in_flight is not None:
                        self._expect_success("update_weights_from_tensor", in_flight.result())
                    in_flight = sender.submit(
                        self.update_weights_from_tensor, payloads, flush_cache=False, weight_version=weight_version
                    )
                    num_buckets += 1
                    num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    if verify:
                        sent.update((name, tensor_checksum(t.to(getattr(torch, self.dtype)))) for name, t in bucket)
                if in_flight is not None:
                    self._expect_success("update_weights_from_tensor", in_flight.result())
        except BaseException:  # leaving the executor waited for the bucket in flight: end the session after it
            with contextlib.suppress(RpcError):  # a dead worker: the bucket's error is the one to report
                self.end_weight_update()
            raise
        self._expect_success("end_weight_update", self.end_weight_update())
        if num_buckets == 0:
            raise ValueError(
                "named_tensors (empty) must hold at least one tensor because a weight sync with nothing "
                "to send is a bug in the exporter"
            )
        if verify:
            self._verify(sent, weight_version)
        return {"num_buckets": num_buckets, "num_bytes": num_bytes, "seconds": time.perf_counter() - start}

    def _verify(self, sent: dict[str, str], weight_version: str) -> None:
        held = self.weight_checksums()
        differ = sorted(name for name, digest in sent.items() if held.get(name) != digest)
        if differ:
            raise EngineOpError(
                f"engine rank {self.rank} holds weights that differ from the trainer's after the sync "
                f"to version {weight_version}: {len(differ)} of {len(sent)} tensors, first "
                f"{differ[:5]}; the exporter or the engine's loader is wrong"
            )

    def _expect_success(self, method: str, result: OpResult) -> None:
        if not result["success"]:
            raise EngineOpError(
                f"{method} on engine rank {self.rank} ({self.endpoint.address}) returned "
                f"success=False: {result['message']}"
            )

    def shutdown(self, graceful: bool = True) -> None:
        """Ask the worker to exit (it aborts what is in flight), kill its process group if it has not
        within a few seconds or does not answer (at once with ``graceful`` False: a worker known to be
        lost); idempotent, and registered with ``atexit``."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            if graceful and self.process.poll() is None:
                try:
                    self.rpc.call("shutdown", timeout_s=SHUTDOWN_REPLY_S)
                    self.process.wait(timeout=SHUTDOWN_GRACE_S)
                except (RpcError, subprocess.TimeoutExpired) as exc:
                    log.warning(
                        "engine worker for rank %d did not exit cleanly (%s); killing process group %d",
                        self.rank,
                        exc,
                        self.process.pid,
                    )
            self.kill()
        finally:
            self.rpc.close()
            self.endpoint.cleanup()

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and any process it started) and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone: the worker exited and left no children
        self.process.wait()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
