"""A process that dies mid-run ends the whole job quickly, and the survivor says who died.

A 2-rank run under torchrun is started on the tiny model; once it is training, one process is
SIGKILLed (a rank: as the OOM killer would; an engine worker: as a CUDA crash would). Every
process of the job (torchrun, both ranks, both engine workers) must be gone within 30 s, and the
surviving rank's watchdog line must name the dead process. Processes are found through /proc
(the children of the torchrun process this test started) and killed only by pid.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume import read_metrics, train_command, train_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 30.0
sys.path.insert(0, str(REPO / "scripts"))
from faults import children, rank_pids  # noqa: E402


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("victim", ["rank", "engine"])
def test_killed_process_ends_every_process_within_30s(tiny_model_dirs, tmp_path, victim):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(tiny_model_dirs["qwen3"], run_dir, "train.num_steps=500"),
        cwd=REPO,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    job: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not read_metrics(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and read_metrics(run_dir), (
            f"run did not start training:\n{proc.stdout.read()[-5000:]}"
        )
        ranks = rank_pids(proc.pid)
        engines = {rank: children(pid) for rank, pid in ranks.items()}
        assert sorted(ranks) == [0, 1] and all(len(e) == 1 for e in engines.values()), (ranks, engines)
        job = [proc.pid, *ranks.values(), *(e[0] for e in engines.values())]
        target = ranks[1] if victim == "rank" else engines[1][0]

        os.kill(target, signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        while any(alive(pid) for pid in job) and time.monotonic() - killed_at < 60:
            time.sleep(0.1)
        elapsed = time.monotonic() - killed_at
        assert not any(alive(pid) for pid in job), (
            f"still running after {elapsed:.0f} s: {[p for p in job if alive(p)]}"
        )
        assert elapsed < DEADLINE_S, f"the job took {elapsed:.1f} s to end"
    finally:
        for pid in job:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    survivor = re.search(r"\[rlrun\] rank 0 \(pid \d+ on [^)]+\) exiting: (.*)", output)
    assert survivor, output[-5000:]
    print(f"{victim} killed: all {len(job)} processes gone after {elapsed:.1f} s; {survivor.group(0)}")
    if victim == "rank":
        assert re.match(rf"rank 1 \(pid {ranks[1]} on [^)]+\) died: its process is gone", survivor.group(1)), (
            survivor.group(0)
        )
    else:  # found by rank 1's watchdog or by its pending engine call, whichever is first
        assert re.search(
            rf"engine worker (of|for) rank 1 .*\(pid {engines[1][0]}\) exited with code -9 \(killed by SIGKILL: ",
            survivor.group(1),
        ), survivor.group(0)


def test_silent_peer_on_another_host_is_declared_dead_after_the_timeout(monkeypatch):
    """The heartbeat path (a peer on another node cannot be checked by pid): a peer whose beat stops
    moving is named after PEER_TIMEOUT_S, one whose beat moves is not; verdicts and this rank's own failure name
    the step and phase the main thread is in. Real TCPStore, no thread."""
    import torch.distributed as dist

    from rlrun.observability.metrics import PhaseTimer
    from rlrun.runtime import watchdog as wd
    from rlrun.runtime.dist import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    me = wd.PeerInfo(rank=0, pid=os.getpid(), host="node-a")
    dog = wd.Watchdog(me, 2, dist.TCPStore("127.0.0.1", port, is_master=False), f"127.0.0.1:{port}", "t/")
    server.set("t/peer/1", '{"rank": 1, "pid": 4242, "host": "node-b"}')
    monkeypatch.setattr(wd, "PEER_TIMEOUT_S", 0.5)
    server.add("t/beat/1", 1)
    assert dog._neighbour_death() is None
    time.sleep(0.3)
    server.add("t/beat/1", 1)  # still beating
    assert dog._neighbour_death() is None
    time.sleep(0.7)
    dog.step = 7
    with PhaseTimer(dog)("sync"):  # the loop's timer tells the watchdog each phase
        verdict = dog._neighbour_death()
    assert verdict is not None and verdict.startswith("rank 1 (pid 4242 on node-b) sent no heartbeat"), verdict
    assert verdict.endswith(
        " at step 7 (sync): its process or node is gone, or it is stuck without releasing the Python GIL"
    )
    server.set("t/done/1", "1")  # a peer that finished normally is no longer watched
    server.get("t/done/1")  # set is not acknowledged: a read on the same connection waits for it
    assert dog._neighbour_death() is None

    # This rank's own failure is published naming its phase: e.g. a collective that timed out waiting for a peer
    # that is alive but stuck (gloo's timeout names its transport; the watcher first looks for a dead peer,
    # PEER_TIMEOUT_S, then publishes; here without the transport's name, so at once).
    dog.phase_started("checkpoint")
    dog.fail(RuntimeError("Timed out waiting 600000ms for recv operation to complete\nmore detail"))
    assert server.get("t/abort").decode() == (
        f"rank 0 (pid {os.getpid()} on node-a) failed at step 7 (checkpoint): RuntimeError: Timed out waiting "
        "600000ms for recv operation to complete"
    )


def test_a_dead_teacher_engine_is_this_ranks_failure(tmp_path):
    """``algorithm.opd.teacher_engine``'s worker is watched beside the engine (rlrun/trainer/loop.py): its
    exit is reported naming it, its pid, the signal and its log, as the engine's is. Real TCPStore and a
    real worker process, no thread."""
    import subprocess

    import torch.distributed as dist

    from rlrun.runtime import watchdog as wd
    from rlrun.runtime.deaths import WatchedProcess
    from rlrun.runtime.dist import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    dog = wd.Watchdog(wd.PeerInfo(0, os.getpid(), "node-a"), 1, server, f"127.0.0.1:{port}", "t/")
    log = tmp_path / "teacher-0.log"
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    teacher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        dog.watch_engine(WatchedProcess(engine, tmp_path / "engine-0.log"))
        dog.watch_engine(WatchedProcess(teacher, log), role="teacher engine")
        dog.step = 3
        assert dog._engine_death() is None
        teacher.kill()
        teacher.wait()
        verdict = dog._engine_death()
        assert verdict is not None and verdict.startswith(
            f"the teacher engine worker of rank 0 (pid {os.getpid()} on node-a) (pid {teacher.pid}) exited with "
            "code -9 (killed by SIGKILL"
        ), verdict
        assert verdict.endswith(f"at step 3 (setup); see {log}"), verdict
    finally:
        for process in (engine, teacher):
            process.kill()
            process.wait()
