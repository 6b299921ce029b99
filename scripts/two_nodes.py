"""Two torchrun "nodes" on this host: the multi-node launch of launch/slurm_multinode.sbatch without Slurm.

    python scripts/two_nodes.py [--work DIR] [--steps 6] [--kill-after 2]

Each node is one torchrun agent (``--nnodes 2 --node-rank 0|1 --nproc-per-node 2``, c10d rendezvous on
127.0.0.1; node 0's agent hosts the store) in its own session, 4 ranks in all, training the quickstart
config on a tiny random Qwen3 (tests/tiny_models.py) with a learnable reward. Three runs, one JSON summary:

1. ``straight``: both nodes to the last step; the reward per step and the run directory's per-rank files
   (engine sockets and logs are named by global rank, so the two nodes' files cannot collide).
2. ``killed``: the same, checkpointing every step; once ``--kill-after`` steps are logged node 1's whole
   session (agent, ranks, engine workers) is SIGKILLed, as a node that dies; the time until node 0's agent
   exits and the lines that say why.
3. ``resumed``: the pair started again on the killed run's directory resumes from its newest checkpoint
   (``checkpoint.resume: auto``); its steps must continue where the checkpoint stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

from faults import Job, children, read_metrics  # noqa: E402

from minimal_config import tiny_task_settings  # noqa: E402

RANKS_PER_NODE = 2
FAILURE = re.compile(r"(Error|error|failed|Failed|exited|SIGKILL|rank \d|node)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node_command(node_rank: int, port: int, run_id: str, model_dir: Path, run_dir: Path, *sets: str) -> list[str]:
    """One node's torchrun agent: 2 ranks, c10d rendezvous on 127.0.0.1:``port`` (node 0 hosts it)."""
    settings = [
        *tiny_task_settings(model_dir, run_dir),
        *sets,
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={RANKS_PER_NODE}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}",
        "--max-restarts=0",
        "-m",
        "rlrun",
        "train",
        str(REPO / "configs/quickstart.yaml"),
        *[a for s in settings for a in ("--set", s)],
    ]


def start_pair(model_dir: Path, run_dir: Path, *sets: str) -> tuple[Job, Job]:
    """Both nodes' agents, each in its own session (node 1's can be killed alone)."""
    port, run_id = free_port(), f"two-nodes-{os.getpid()}-{time.monotonic_ns()}"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return tuple(Job(node_command(n, port, run_id, model_dir, run_dir, *sets), env) for n in (0, 1))


def finish(pair: tuple[Job, Job], timeout_s: float) -> list[int]:
    try:
        return [job.wait(timeout_s) for job in pair]
    finally:
        for job in pair:
            job.kill()


def run_files(run_dir: Path) -> list[str]:
    """Per-rank files the ranks left in the run directory (engine logs; sockets are removed at exit)."""
    return sorted(p.name for p in run_dir.glob("engine-*"))


def straight(model_dir: Path, work: Path, steps: int) -> dict:
    run_dir = work / "straight"
    pair = start_pair(model_dir, run_dir, f"train.num_steps={steps}")
    codes = finish(pair, 1200)
    metrics = read_metrics(run_dir)
    return {
        "exit_codes": codes,
        "steps": [m["step"] for m in metrics],
        "reward": [round(m["rollout/raw_reward_mean"], 4) for m in metrics],
        "run_dir_files": run_files(run_dir),
        "node0_tail": pair[0].tail(5) if any(codes) else "",
    }


def kill_node(model_dir: Path, work: Path, steps: int, kill_after: int, wait_s: float = 120) -> dict:
    """SIGKILL node 1's session once ``kill_after`` steps are logged; how node 0 ends and how fast."""
    run_dir = work / "killed"
    pair = start_pair(model_dir, run_dir, f"train.num_steps={steps}", "checkpoint.save_interval=1")
    try:
        deadline = time.monotonic() + 900
        while len(read_metrics(run_dir)) < kill_after:
            if any(job.proc.poll() is not None for job in pair) or time.monotonic() > deadline:
                raise RuntimeError(f"the pair ended or stalled before step {kill_after}:\n{pair[0].tail()}")
            time.sleep(0.01)
        killed_at = time.monotonic()
        os.killpg(pair[1].proc.pid, signal.SIGKILL)
        left: dict[str, list[int]] = {}
        try:
            code: int | None = pair[0].wait(wait_s)
        except subprocess.TimeoutExpired:  # what of node 0 is still there
            code, ranks = None, children(pair[0].proc.pid)
            left = {"agent": [pair[0].proc.pid], "ranks": ranks, "engines": [c for r in ranks for c in children(r)]}
        ended_at = time.monotonic()
    finally:
        for job in pair:
            job.kill()
    after = [line for t, line in pair[0].lines if t >= killed_at]
    reasons = [line for line in after if FAILURE.search(line) and "warn" not in line.lower()]
    return {
        "killed_after_step": kill_after,
        "node0_exit_code": code,
        "detection_s": round(ended_at - killed_at, 2) if code is not None else None,
        "node0_left_after_s": {"seconds": wait_s, **left} if code is None else None,
        "node0_messages": reasons[:12],
        "node0_tail": pair[0].tail(15) if code is None else "",
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")),
    }


def resume(model_dir: Path, work: Path, steps: int) -> dict:
    run_dir = work / "killed"
    before = [m["step"] for m in read_metrics(run_dir)]
    pair = start_pair(model_dir, run_dir, f"train.num_steps={steps}", "checkpoint.save_interval=1")
    codes = finish(pair, 1200)
    lines = [line for _, line in pair[0].lines if "resum" in line.lower()]
    return {
        "exit_codes": codes,
        "steps_before": before,
        "steps_after": [m["step"] for m in read_metrics(run_dir)],
        "resume_lines": lines[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=2)
    parser.add_argument("--only-kill", action="store_true", help="the kill and the resume, not the straight run")
    args = parser.parse_args()
    from tiny_models import make_tiny_model

    work = args.work or Path(tempfile.mkdtemp(prefix="two-nodes-"))
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        make_tiny_model("qwen3", model_dir)
    summary = {} if args.only_kill else {"straight": straight(model_dir, work, args.steps)}
    summary["kill"] = kill_node(model_dir, work, args.steps, args.kill_after)
    print(json.dumps(summary, indent=1), flush=True)
    summary["resume"] = resume(model_dir, work, args.steps)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
