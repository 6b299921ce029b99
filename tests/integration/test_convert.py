"""``rlrun convert``: HF -> Megatron distributed checkpoint (TP=2) -> HF reproduces every original tensor bit
for bit, for each tiny family (tied embeddings, QKV bias, QK-norm, and the RoPE-scaling and Mistral kinds of
tiny_models.FAMILY_KINDS, whose 3 key/value groups are padded to 4 at TP=2); config and tokenizer files are copied;
``checkpoint.load`` of the converted directory into a bf16 model gives the weights ``build_model`` loads from the
HF directory, also after an update (the optimizer's fp32 main weights follow the load).

The families run on one pair of ranks (the conversion classes the CLI runs on its ranks); the CLI itself,
which starts its ranks, is run end to end for the tied family at PP=2 (its last stage holds a copy of the
embedding that must not be exported twice).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_distributed
from tiny_models import FAMILY_KINDS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("llama", "qwen2", "qwen3", *FAMILY_KINDS)


@dataclass
class Batch:
    tokens: torch.Tensor
    position_ids: torch.Tensor


def _round_trips(hf_dirs: dict[str, str], out_root: str) -> dict:
    """On 2 ranks (TP=2): each family to a checkpoint and back; then a converted checkpoint loaded by the
    run's checkpointer (checkpoint.load) into a freshly built model."""
    import torch.distributed as dist

    from rlrun.config.schema import CheckpointConfig
    from rlrun.megatron import build_model, make_optimizer, train_step
    from rlrun.runtime.dist import destroy_distributed, init_distributed
    from rlrun.tools.convert import HfToMcore, McoreToHf
    from rlrun.trainer.checkpoint import ACTOR, Checkpointer

    parallel = init_distributed(tp=2, pp=1, seed=0)
    for family, hf_dir in hf_dirs.items():
        ckpt, hf_out = Path(out_root) / family / "mcore", Path(out_root) / family / "hf"
        if parallel.is_rank0:
            (ckpt / ACTOR).mkdir(parents=True)
            hf_out.mkdir(parents=True)
        dist.barrier()
        HfToMcore(Path(hf_dir), ckpt, tp=2, pp=1, dtype="float32").run(parallel)
        McoreToHf(ckpt, hf_out, Path(hf_dir), "float32").run(parallel)
    hf_dir = hf_dirs["qwen3"]
    expected = {
        k: v.clone()
        for k, v in build_model(hf_dir, parallel, dtype="bfloat16").module.state_dict().items()
        if v is not None
    }
    # A bf16 model with zeroed weights (and so zeroed fp32 main weights in its optimizer): only checkpoint.load
    # can bring the converted ones back, and an update with LR 0 copies the main weights back into the model.
    model = build_model(hf_dir, parallel, dtype="bfloat16")
    with torch.no_grad():
        for param in model.module.parameters():
            param.zero_()
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, clip_grad=0.0)
    cfg = CheckpointConfig(load=str(Path(out_root) / "qwen3" / "mcore"))
    run_state = Checkpointer(cfg, Path(out_root) / "run", parallel).restore(model, optimizer, None)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    tokens = torch.arange(8).reshape(1, 8)
    train_step(
        model,
        optimizer,
        [Batch(tokens, torch.arange(8).reshape(1, 8))],
        lambda mb, logprobs: (-logprobs.sum(), {}),
        num_global_tokens=7,
        temperature=1.0,
    )
    loaded = {k: v.clone() for k, v in model.module.state_dict().items() if v is not None}
    destroy_distributed()
    return {"expected": expected, "loaded": loaded, "run_state": run_state}


def assert_same_hf_dir(original: Path, converted: Path) -> None:
    want, got = load_file(original / "model.safetensors"), load_file(converted / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), f"{name} differs"
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / file).read_bytes() == (original / file).read_bytes(), file


def test_round_trip_is_exact_for_every_family_at_tp2(tiny_model_dirs, family_model_dirs, tmp_path):
    hf_dirs = {family: str({**tiny_model_dirs, **family_model_dirs}[family]) for family in FAMILIES}
    result = run_distributed(_round_trips, 2, hf_dirs, str(tmp_path))
    for family in FAMILIES:
        assert_same_hf_dir(Path(hf_dirs[family]), tmp_path / family / "hf")
    assert result["run_state"] == {}  # weights only: the run starts at step 0
    assert result["loaded"].keys() == result["expected"].keys()
    for name, tensor in result["expected"].items():
        assert torch.equal(result["loaded"][name], tensor), name


def test_cli_round_trip(tiny_model_dirs, tmp_path):
    hf_dir = tiny_model_dirs["llama"]
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    rlrun = [sys.executable, "-m", "rlrun", "convert"]
    steps = [
        ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "mcore"), "--pp", "2"],
        ["mcore-to-hf", "--ckpt", str(tmp_path / "mcore"), "--out", str(tmp_path / "hf")],
    ]
    for args in steps:
        proc = subprocess.run(rlrun + args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_hf_dir(hf_dir, tmp_path / "hf")
    again = subprocess.run(rlrun + steps[0], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "must not hold a checkpoint already" in again.stderr
    missing = subprocess.run(
        rlrun + ["mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "x")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and f"--ckpt ({tmp_path}) must be a complete checkpoint" in missing.stderr


def _fail_on_rank_0(parallel) -> None:
    """Rank 0 fails; the other rank waits for it in a collective (what a failed shard load looks like)."""
    import torch.distributed as dist

    if parallel.rank == 0:
        raise ValueError("shard unreadable")
    dist.barrier()


def _succeed(parallel) -> None:
    import torch.distributed as dist

    dist.barrier()


def test_a_failed_rank_stops_the_conversion_instead_of_hanging_it():
    """The other rank waits in a barrier that never completes; the conversion must end with rank 0's error."""
    from rlrun.tools.convert import _on_ranks

    with pytest.raises(RuntimeError, match="shard unreadable"):
        _on_ranks(_fail_on_rank_0, tp=2, pp=1)


def test_a_port_taken_before_the_ranks_bind_it_is_retried(monkeypatch, caplog):
    """free_port picks a port that another process takes before rank 0 listens on it: the ranks start again."""
    import socket

    from rlrun.runtime import dist as rlrun_dist
    from rlrun.tools.convert import _on_ranks

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real_free_port = rlrun_dist.free_port
    monkeypatch.setattr(rlrun_dist, "free_port", lambda: ports.pop() if ports else real_free_port())
    try:
        _on_ranks(_succeed, tp=2, pp=1)
    finally:
        taken.close()
    assert ports == [], "the taken port was not tried first"
    assert "retrying on another" in caplog.text
