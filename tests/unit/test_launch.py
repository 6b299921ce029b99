"""The launch scripts: they parse (``bash -n``), and the 2-node Slurm job renders the exact srun +
torchrun command, which torch's own torchrun argument parser and rlrun's CLI both accept."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("launch/*.sh"), *REPO.glob("launch/*.sbatch")])
CONFIG = "configs/quickstart.yaml"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()


def render(script: str, tmp_path: Path, **env: str) -> str:
    """Run a launcher with RLRUN_DRY_RUN=1 under a fake allocation; ``scontrol`` expands the node list
    as Slurm does (only what the script asks of it is implemented)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(
        '#!/usr/bin/env bash\n[[ "$1 $2 $3" == "show hostnames gpu-[07-08]" ]] && printf "gpu-07\\ngpu-08\\n"\n'
    )
    scontrol.chmod(0o755)
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RLRUN_DRY_RUN": "1", **env}
    proc = subprocess.run(
        ["bash", script, CONFIG, "--set", "train.num_steps=3", "--set", "rollout.temperature=0.7"],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.strip()


SLURM_2_NODES = {
    "SLURM_SUBMIT_DIR": str(REPO),
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu-[07-08]",
    "SLURM_GPUS_ON_NODE": "8",
    "TORCHRUN": "torchrun",
}


def test_two_node_sbatch_renders_the_exact_command(tmp_path):
    command = render("launch/slurm_multinode.sbatch", tmp_path, **SLURM_2_NODES)
    assert command == (
        "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpu-bind=none "
        "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=gpu-07:29500 --rdzv-id=4242 "
        "--max-restarts=0 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=300 "
        "--log-dir=logs/slurm-4242 --tee=3 --local-ranks-filter=0 "
        "-m rlrun train configs/quickstart.yaml --set train.num_steps=3 --set rollout.temperature=0.7"
    )


def test_rendered_torchrun_arguments_are_what_torchrun_and_rlrun_accept(tmp_path):
    from torch.distributed.run import get_args_parser

    argv = shlex.split(render("launch/slurm_multinode.sbatch", tmp_path, **SLURM_2_NODES))
    args = get_args_parser().parse_args(argv[argv.index("torchrun") + 1 :])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "2",
        "8",
        "c10d",
        "gpu-07:29500",
        "4242",
    )
    assert args.module and args.training_script == "rlrun" and args.max_restarts == 0
    assert "SIGUSR1" in args.signals_to_handle.split(",")
    proc = subprocess.run(
        [sys.executable, "-m", "rlrun", "config", "show", *args.training_script_args[1:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "num_steps: 3" in proc.stdout and "temperature: 0.7" in proc.stdout


def test_sbatch_headers_ask_for_one_and_two_nodes_and_a_checkpoint_signal():
    for name, nodes in (("slurm_1node.sbatch", "1"), ("slurm_multinode.sbatch", "2")):
        header = [line for line in (REPO / "launch" / name).read_text().splitlines() if line.startswith("#SBATCH")]
        assert f"#SBATCH --nodes={nodes}" in header
        assert "#SBATCH --signal=USR1@300" in header


def test_local_launcher_renders_a_standalone_torchrun(tmp_path):
    command = render("launch/local.sh", tmp_path, NPROC="4", RLRUN_VENV=".venv")
    assert command == (
        ".venv/bin/torchrun --standalone --nproc-per-node=4 "
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=300 "
        "-m rlrun train configs/quickstart.yaml --set train.num_steps=3 --set rollout.temperature=0.7"
    )
