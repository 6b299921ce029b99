"""A trainer rank never hangs on its engine worker, and never leaves one behind.

Each test starts real processes and kills only those (by pid or by the worker's own process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import rlrun
from engine_contract import pid_alive, spawn_engine, wait_for_inflight, wait_until_dead
from rlrun.engine.registry import BackendSpec
from rlrun.engine.rpc import RpcPeerDiedError, RpcUnresponsiveError

pytestmark = pytest.mark.slow

PROMPT = [[72, 101, 108, 108, 111, 33]]
LONG = {"max_new_tokens": 500, "ignore_eos": True}
DETECT_WITHIN_S = 10.0
PACKAGE_ROOT = str(Path(rlrun.__file__).resolve().parents[1])


def generate_in_background(engine) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = engine.generate(PROMPT, LONG)
        except Exception as exc:  # handed to the test thread
            out["error"], out["raised_at"] = exc, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for_inflight(engine, out)
    return thread, out


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_worker_killed_mid_generate_fails_the_call_with_exit_code_and_log(backend, tiny_model_dirs, tmp_path):
    engine = spawn_engine(backend, tiny_model_dirs["qwen2"], tmp_path, rank=1, request_timeout_s=300)
    try:
        thread, out = generate_in_background(engine)
        killed_at = time.monotonic()
        os.kill(engine.process.pid, signal.SIGKILL)
        thread.join(timeout=DETECT_WITHIN_S + 5)
        error = out.get("error")
        assert isinstance(error, RpcPeerDiedError), out
        assert out["raised_at"] - killed_at < DETECT_WITHIN_S
        message = str(error)
        assert "generate on ipc://" in message and f"engine worker for rank 1 (pid {engine.process.pid})" in message
        assert "exited with code -9 (killed by SIGKILL: " in message and "OOM killer" in message
        assert "); last lines of" in message and "serving" in message
    finally:
        engine.shutdown()
    engine.shutdown()  # idempotent
    assert not pid_alive(engine.process.pid)


def test_stopped_worker_misses_heartbeats_and_fails_the_call_within_10_s(tiny_model_dirs, tmp_path):
    engine = spawn_engine("embedded", tiny_model_dirs["qwen2"], tmp_path, request_timeout_s=300)
    try:
        thread, out = generate_in_background(engine)
        stopped_at = time.monotonic()
        os.kill(engine.process.pid, signal.SIGSTOP)
        thread.join(timeout=DETECT_WITHIN_S + 5)
        assert isinstance(out.get("error"), RpcUnresponsiveError), out
        assert out["raised_at"] - stopped_at < DETECT_WITHIN_S
        assert "process state T (stopped by a signal)" in str(out["error"])
    finally:
        engine.shutdown()  # the stopped worker cannot answer: its process group is killed
    assert wait_until_dead(engine.process.pid, timeout_s=5) < 5


TRAINER = textwrap.dedent("""
    import signal
    import sys
    from pathlib import Path
    # As in a terminal: a test runner started in the background (``cmd &``) passes SIGINT on ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from rlrun.engine.registry import BackendSpec
    from rlrun.engine.client import EngineClient
    with EngineClient.spawn(BackendSpec("embedded", sys.argv[1], 0), run_dir=Path(sys.argv[2]), rank=0) as engine:
        print(engine.process.pid, flush=True)
        while True:  # always mid-generate when the signal comes, however fast the engine is
            engine.generate([[72, 101, 108]], {"max_new_tokens": 500, "ignore_eos": True})
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_trainer_interrupted_or_killed_mid_generate_leaves_no_worker(signum, tiny_model_dirs, tmp_path):
    """Ctrl-C: KeyboardInterrupt unwinds through EngineClient.shutdown. SIGKILL: nothing runs in the
    trainer, the worker's parent-death signal ends it."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tiny_model_dirs["qwen2"]), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": PACKAGE_ROOT},
    )
    try:
        worker_pid = int(trainer.stdout.readline())
        time.sleep(1.0)  # inside a generate
        assert pid_alive(worker_pid)
        trainer.send_signal(signum)
        _, stderr = trainer.communicate(timeout=30)
    finally:
        trainer.kill()
        trainer.wait()
    assert wait_until_dead(worker_pid, timeout_s=DETECT_WITHIN_S) < DETECT_WITHIN_S
    if signum == signal.SIGINT:
        assert trainer.returncode != 0 and "KeyboardInterrupt" in stderr


def test_watchdog_exits_when_parent_pid_dies_even_without_pdeathsig(tiny_model_dirs, tmp_path):
    """``--parent-pid`` names a process that is not the worker's real parent, so only the watchdog
    thread (not PR_SET_PDEATHSIG) can notice its death."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    spec = BackendSpec(backend="embedded", model_path=str(tiny_model_dirs["qwen2"]), seed=0)
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log_file:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlrun.engine.worker",
                "--endpoint",
                f"ipc://{tmp_path}/w.sock",
                "--parent-pid",
                str(stand_in.pid),
                "--spec",
                spec.to_json(),
            ],
            stderr=log_file,
            env={**os.environ, "PYTHONPATH": PACKAGE_ROOT},
        )
    try:
        time.sleep(0.5)
        assert worker.poll() is None
    finally:
        stand_in.kill()
        stand_in.wait()
    try:
        assert worker.wait(timeout=10) == 3
        assert f"parent {stand_in.pid} died" in log_path.read_text()
    finally:
        worker.kill()
        worker.wait()


def test_worker_dying_at_startup_is_reported_with_exit_code_and_log_tail(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(RpcPeerDiedError) as failure:
        spawn_engine("embedded", missing, tmp_path, rank=2, startup_timeout_s=120)
    message = str(failure.value)
    assert "engine worker for rank 2 (embedded backend" in message and "did not start" in message
    assert "exited with code 1" in message and str(missing) in message.split("last lines of", 1)[1]
