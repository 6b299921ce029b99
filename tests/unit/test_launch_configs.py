"""Ready configs: every one loads; the GPU ones fit the Slurm scripts they name; the DAPO converter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlrun.config import load_config

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIGS = {"qwen3-0.6b-gsm8k.yaml": "slurm_1node.sbatch", "qwen3-4b-dapo-math.yaml": "slurm_multinode.sbatch"}


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_config_loads(name):
    load_config(REPO / "configs" / name, [])


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_fits_its_slurm_script(name):
    cfg = load_config(REPO / "configs" / name, [])
    header = dict(
        line.removeprefix("#SBATCH --").split("=", 1)
        for line in (REPO / "launch" / GPU_CONFIGS[name]).read_text().splitlines()
        if line.startswith("#SBATCH") and "=" in line
    )
    world_size = int(header["nodes"]) * int(header["gpus-per-node"])
    assert cfg.engine.backend == "sglang" and cfg.model.dtype == "bfloat16"
    assert world_size % (cfg.parallel.tp * cfg.parallel.pp) == 0
    assert cfg.rollout.prompts_per_step % world_size == 0, "every engine should get the same number of prompts"
    assert cfg.checkpoint.save_interval > 0 and cfg.checkpoint.resume == "auto"
    assert f"sbatch launch/{GPU_CONFIGS[name]} configs/{name}" in (REPO / "configs" / name).read_text()


def test_dapo_converter_keeps_the_problem_asks_for_boxed_and_dedups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from configs.data.make_dapo_math import convert

    content = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $1+1$?\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    row = {"prompt": [{"role": "user", "content": content}], "reward_model": {"ground_truth": "2", "style": "rule"}}
    other = {
        "prompt": [{"role": "user", "content": "Compute $3^2$."}],
        "reward_model": {"ground_truth": "9", "style": "rule"},
    }
    pq.write_table(pa.Table.from_pylist([row, other, row]), tmp_path / "dapo.parquet")
    assert convert(tmp_path / "dapo.parquet", tmp_path / "out.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows == [
        {
            "prompt": "What is $1+1$?\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
            "label": "2",
        },
        {
            "prompt": "Compute $3^2$.\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
            "label": "9",
        },
    ]
