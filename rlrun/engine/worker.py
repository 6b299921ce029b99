"""The engine worker process: one backend behind the contract's RPC, dying with its trainer rank.

    python -m rlrun.engine.worker --endpoint ipc://RUN_DIR/engine-0.sock --backend embedded \\
        --model HF_DIR --seed 0 --parent-pid PID [--dtype float32]

Started by :class:`rlrun.engine.client.EngineClient`, which redirects its stdout/stderr to a log
file in the run directory and passes the trainer's multiprocessing ``authkey`` in
``RLRUN_ENGINE_AUTHKEY`` (CPU tensor payloads are shared-memory fds handed over by the trainer's
``resource_sharer``, which only answers processes holding the same key).

Requests are served one at a time, so a generate call has finished before any other call is read:
``abort`` has nothing to abort and ``num_inflight`` is 0 whenever another method runs. The rules
are still checked (``rlrun.engine.lifecycle``) so a concurrent backend inherits them unchanged.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

from rlrun.engine.backends import BACKENDS, EngineBackend, load_backend
from rlrun.engine.lifecycle import EngineLifecycle
from rlrun.engine.rpc import RpcServer
from rlrun.engine.types import EngineStatus, GenResult, OpResult

log = logging.getLogger("rlrun.engine.worker")

AUTHKEY_ENV = "RLRUN_ENGINE_AUTHKEY"
PR_SET_PDEATHSIG = 1
WATCHDOG_INTERVAL_S = 1.0
EXIT_PARENT_DIED = 3


def _parent_alive(parent_pid: int) -> bool:
    """False once the parent is gone or a zombie (killed but not yet reaped by its own parent)."""
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    stat = Path(f"/proc/{parent_pid}/stat")
    if stat.exists():
        state = stat.read_text().rsplit(")", 1)[-1].split()[0]
        return state not in ("Z", "X")
    return True


def die_with_parent(parent_pid: int) -> None:
    """Exit when ``parent_pid`` dies, even if it is SIGKILLed and cannot clean up.

    Two mechanisms, because each has a blind spot: PR_SET_PDEATHSIG (Linux) fires when the *thread*
    that forked us exits and only for the real parent; the watchdog thread polls ``parent_pid``
    (which may be a grandparent launcher) once a second and also covers non-Linux systems.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

    def watch() -> None:
        while _parent_alive(parent_pid):
            time.sleep(WATCHDOG_INTERVAL_S)
        print(f"engine worker {os.getpid()}: parent {parent_pid} died; exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_PARENT_DIED)

    if not _parent_alive(parent_pid):  # it died before prctl took effect
        os._exit(EXIT_PARENT_DIED)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class EngineWorker:
    """The contract's methods: rules from :class:`EngineLifecycle`, work by the backend."""

    METHODS = ("health", "generate", "abort", "pause_generation", "continue_generation", "flush_cache",
               "release_memory_occupation", "resume_memory_occupation", "begin_weight_update",
               "update_weights_from_tensor", "end_weight_update", "get_weight_version", "shutdown")

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend
        self.lifecycle = EngineLifecycle()
        self.stop = threading.Event()

    def handlers(self) -> dict:
        return {name: getattr(self, name) for name in self.METHODS}

    def health(self) -> EngineStatus:
        return self.lifecycle.status(self.backend.weight_version)

    def generate(self, input_ids: list[list[int]], sampling_params: dict | list[dict],
                 return_logprob: bool = True, rids: list[str] | None = None) -> list[GenResult]:
        with self.lifecycle.generating():
            return self.backend.generate(input_ids, sampling_params, return_logprob=return_logprob, rids=rids)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """A no-op: requests are served one at a time, so none is in flight when this runs."""

    def pause_generation(self, mode: str = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode ({mode!r}) must be 'abort', 'retract' or 'in_place' as in SGLang")
        self.lifecycle.paused = True

    def continue_generation(self) -> None:
        self.lifecycle.paused = False

    def flush_cache(self) -> OpResult:
        refused = self.lifecycle.check_flush()
        if refused is not None:
            return refused
        self.backend.flush_cache()
        return {"success": True, "message": "Cache flushed."}

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.backend.release_memory_occupation(self.lifecycle.release(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.backend.resume_memory_occupation(self.lifecycle.resume(tags))

    def begin_weight_update(self) -> OpResult:
        result = self.lifecycle.begin_update()
        if result["success"]:
            self.backend.begin_weight_update()
        return result

    def update_weights_from_tensor(self, serialized_named_tensors: list[bytes], load_format: str = "flattened_bucket",
                                   flush_cache: bool = False, weight_version: str | None = None) -> OpResult:
        refused = self.lifecycle.check_update("update_weights_from_tensor")
        if refused is not None:
            return refused
        try:
            self.backend.update_weights_from_tensor(serialized_named_tensors, load_format, weight_version)
        except Exception as exc:  # the contract reports load failures as success=False, like SGLang
            log.exception("update_weights_from_tensor failed")
            return {"success": False, "message": f"Failed to update weights: {type(exc).__name__}: {exc}"}
        if flush_cache:
            return self.flush_cache()
        return {"success": True, "message": "Success"}

    def end_weight_update(self) -> OpResult:
        result = self.lifecycle.end_update()
        if result["success"]:
            self.backend.end_weight_update()
        return result

    def get_weight_version(self) -> str:
        return self.backend.weight_version

    def shutdown(self) -> None:
        """Stop serving after this reply; the process then exits."""
        self.stop.set()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlrun.engine.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--endpoint", required=True, help="ZMQ address to bind (ipc://... or tcp://127.0.0.1:PORT)")
    parser.add_argument("--backend", required=True, choices=BACKENDS)
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--seed", type=int, required=True, help="engine seed for requests without sampling_seed")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process dies")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    die_with_parent(args.parent_pid)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s engine-worker[{os.getpid()}] %(levelname)s %(message)s")
    if AUTHKEY_ENV in os.environ:
        multiprocessing.current_process().authkey = bytes.fromhex(os.environ[AUTHKEY_ENV])
    import torch

    torch.set_num_threads(1)  # one process per core is fastest on small CPU boxes (quickstart-task.md)
    backend = load_backend(args.backend, model_path=args.model, seed=args.seed, dtype=args.dtype)
    worker = EngineWorker(backend)
    server = RpcServer(args.endpoint, worker.handlers(), local_only={"update_weights_from_tensor"})
    log.info("serving %s backend for %s on %s", args.backend, args.model, args.endpoint)
    try:
        server.serve(worker.stop)
    finally:
        server.close()
        backend.shutdown()
    log.info("shut down")


if __name__ == "__main__":
    main()
