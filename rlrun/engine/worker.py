"""The engine worker process: one backend behind the contract's RPC, dying with its trainer rank.

    python -m rlrun.engine.worker --endpoint ipc://RUN_DIR/engine-0.sock --parent-pid PID --spec JSON

Started by :class:`rlrun.engine.client.EngineClient`, which redirects its stdout/stderr to a log
file in the run directory, starts it in its own process group (so the client can kill the whole
tree, SGLang's scheduler processes included) and passes two secrets in the environment: the RPC
token (``RLRUN_ENGINE_TOKEN``) and the trainer's multiprocessing ``authkey``
(``RLRUN_ENGINE_AUTHKEY``; CPU tensor payloads are shared-memory fds handed over by the trainer's
``resource_sharer``, which only answers processes holding the same key).

The RPC server runs on an asyncio loop and serves every request in its own task, so ``health``,
``abort`` and ``pause_generation`` are answered while a ``generate`` is in flight. The contract's
rules (``rlrun.engine.lifecycle``) are checked here, before the backend sees a call.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid

from rlrun.engine.lifecycle import EngineLifecycle
from rlrun.engine.registry import BackendSpec, EngineBackend, load_backend
from rlrun.engine.rpc import RpcServer
from rlrun.engine.sampling import per_prompt_params
from rlrun.engine.types import EngineStatus, GenResult, OpResult
from rlrun.runtime.processes import process_alive

log = logging.getLogger("rlrun.engine.worker")

AUTHKEY_ENV = "RLRUN_ENGINE_AUTHKEY"
TOKEN_ENV = "RLRUN_ENGINE_TOKEN"
PR_SET_PDEATHSIG = 1
WATCHDOG_INTERVAL_S = 1.0
EXIT_PARENT_DIED = 3
PAUSE_POLL_S = 0.01
PAUSE_MODES = ("abort", "retract", "in_place")


def die_with_parent(parent_pid: int) -> None:
    """Exit when ``parent_pid`` dies, even if it is SIGKILLed and cannot clean up.

    Two mechanisms, because each has a blind spot: PR_SET_PDEATHSIG (Linux) fires when the *thread*
    that forked us exits and only for the real parent; the watchdog thread polls ``parent_pid``
    (which may be a grandparent launcher) once a second and also covers non-Linux systems.
    SGLang's own child processes set PR_SET_PDEATHSIG themselves, so they follow this one.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

    def exit_orphaned() -> None:
        print(f"engine worker {os.getpid()}: parent {parent_pid} died; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PARENT_DIED)

    def watch() -> None:
        while process_alive(parent_pid):
            time.sleep(WATCHDOG_INTERVAL_S)
        exit_orphaned()

    if not process_alive(parent_pid):  # it died before prctl took effect
        exit_orphaned()
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class EngineWorker:
    """The contract's methods: rules from :class:`EngineLifecycle`, work by the backend."""

    METHODS = (
        "health",
        "generate",
        "abort",
        "pause_generation",
        "continue_generation",
        "flush_cache",
        "release_memory_occupation",
        "resume_memory_occupation",
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
        "get_weight_version",
        "weight_checksums",
        "score_tokens",
        "shutdown",
    )

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend
        self.lifecycle = EngineLifecycle()
        self.stop = threading.Event()
        self._memory_ops = asyncio.Lock()  # one release/resume at a time

    def handlers(self) -> dict:
        return {name: getattr(self, name) for name in self.METHODS}

    def health(self) -> EngineStatus:
        return self.lifecycle.status(self.backend.weight_version)

    async def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict | list[dict],
        return_logprob: bool = True,
        rids: list[str] | None = None,
    ) -> list[GenResult]:
        params = per_prompt_params(len(input_ids), sampling_params)
        rids = rids if rids is not None else [uuid.uuid4().hex for _ in input_ids]
        if len(rids) != len(input_ids):
            raise ValueError(f"rids ({len(rids)} ids) must have one id per prompt ({len(input_ids)}); pass None or fix")
        with self.lifecycle.generating():
            return await self.backend.generate(input_ids, params, return_logprob, rids)

    async def score_tokens(
        self, input_ids: list[list[int]], starts: list[int], temperature: float = 1.0
    ) -> list[list[float]]:
        """Each sequence's log-probs of its tokens from ``starts[i]`` on (a teacher engine scoring samples)."""
        with self.lifecycle.generating():
            return await self.backend.score_tokens(input_ids, starts, temperature)

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort in-flight samples whose rid starts with ``rid`` (all with ``abort_all``); they return
        their partial output with finish_reason type ``abort``. An empty rid alone does nothing (SGLang)."""
        await self.backend.abort(rid, abort_all)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Refuse new generate calls until ``continue_generation``. ``abort`` mode also aborts what is in
        flight and returns once it has all returned; ``in_place``/``retract`` hold it until continue."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode ({mode!r}) must be one of {PAUSE_MODES} as in SGLang's PauseGenerationReqInput")
        self.lifecycle.paused = True
        await self.backend.pause_generation(mode)
        while mode == "abort" and self.lifecycle.num_inflight:
            await asyncio.sleep(PAUSE_POLL_S)

    async def continue_generation(self) -> None:
        await self.backend.continue_generation()
        self.lifecycle.paused = False

    async def flush_cache(self) -> OpResult:
        refused = self.lifecycle.check_flush()
        return refused if refused is not None else await self.backend.flush_cache()

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        async with self._memory_ops:
            await self.backend.release_memory_occupation(self.lifecycle.release(tags))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        async with self._memory_ops:
            tags = self.lifecycle.check_resume(tags)
            await self.backend.resume_memory_occupation(tags)
            self.lifecycle.resume(tags)

    async def begin_weight_update(self) -> OpResult:
        result = self.lifecycle.begin_update()
        if result["success"]:
            backend_result = await self.backend.begin_weight_update()
            if not backend_result["success"]:
                self.lifecycle.end_update()
                return backend_result
        return result

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[bytes],
        load_format: str = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> OpResult:
        refused = self.lifecycle.check_update("update_weights_from_tensor")
        if refused is not None:
            return refused
        if len(serialized_named_tensors) != self.backend.tp_size:
            return {
                "success": False,
                "message": (
                    f"serialized_named_tensors ({len(serialized_named_tensors)} payloads) must hold one payload per "
                    f"engine TP rank ({self.backend.tp_size}) because TP rank r unpickles only payload r"
                ),
            }
        try:
            result = await self.backend.update_weights_from_tensor(
                serialized_named_tensors, load_format, weight_version
            )
        except Exception as exc:  # the contract reports load failures as success=False, like SGLang
            log.exception("update_weights_from_tensor failed")
            return {"success": False, "message": f"Failed to update weights: {type(exc).__name__}: {exc}"}
        if result["success"] and flush_cache:
            return await self.flush_cache()
        return result

    async def end_weight_update(self) -> OpResult:
        result = self.lifecycle.end_update()
        if result["success"]:
            return await self.backend.end_weight_update()
        return result

    def get_weight_version(self) -> str:
        return self.backend.weight_version

    async def weight_checksums(self) -> dict[str, str]:
        """sha256 of every weight's bytes by HF name: a debug check that a sync landed exactly."""
        if "weights" in self.lifecycle.released_tags:
            raise RuntimeError(
                "weight_checksums must not run while the weights tag is released because the "
                "weights are not resident then; call resume_memory_occupation(['weights']) first"
            )
        return await self.backend.weight_checksums()

    async def shutdown(self) -> None:
        """Abort what is in flight and stop serving after this reply; the process then exits."""
        await self.backend.abort("", abort_all=True)
        self.stop.set()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlrun.engine.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", required=True, help="ZMQ address to bind (ipc://... or tcp://127.0.0.1:PORT)")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("--spec", required=True, help="BackendSpec as JSON (rlrun.engine.registry)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s engine-worker[{os.getpid()}] %(levelname)s %(message)s",
    )
    if AUTHKEY_ENV in os.environ:
        multiprocessing.current_process().authkey = bytes.fromhex(os.environ[AUTHKEY_ENV])
    token = bytes.fromhex(os.environ.pop(TOKEN_ENV, ""))
    spec = BackendSpec.from_json(args.spec)
    import torch

    torch.set_num_threads(1)  # one process per core is fastest on small CPU boxes (quickstart-task.md)
    backend = load_backend(spec)
    loop = backend.loop if backend.loop is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    worker = EngineWorker(backend)
    server = RpcServer(args.endpoint, worker.handlers(), local_only={"update_weights_from_tensor"}, token=token)
    log.info("serving %s backend for %s on %s", spec.backend, spec.model_path, args.endpoint)
    try:
        loop.run_until_complete(server.serve(worker.stop))
    finally:
        server.close()
        backend.shutdown()
    log.info("shut down")


if __name__ == "__main__":
    main()
