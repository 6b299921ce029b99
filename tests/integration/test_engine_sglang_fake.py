"""The SGLang adapter's side of the contract that the shared suite cannot see: how it starts
``sglang.Engine`` (arguments and environment), SGLang 0.5.17's API, and that the fake really dies
where SGLang dies (which is why the worker refuses those calls up front)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from engine_contract import FAKES_DIR, spawn_engine
from transformers import AutoModelForCausalLM

import rlrun

pytestmark = pytest.mark.slow

PACKAGE_ROOT = str(Path(rlrun.__file__).resolve().parents[1])
NOT_IN_SESSION = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"


def engine_record(log_path: Path) -> dict:
    """The fake's ``fake-sglang-engine {json}`` line: constructor kwargs and environment facts."""
    line = next(line for line in log_path.read_text().splitlines() if line.startswith("fake-sglang-engine "))
    return json.loads(line.split(" ", 1)[1])


def test_adapter_starts_sglang_as_the_contract_says_on_0_5_23_and_0_5_17(tiny_model_dirs, tmp_path, monkeypatch):
    for key, value in {"CUDA_VISIBLE_DEVICES": "3,5", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                       "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)  # a torchrun rank's environment; the workers inherit what they should
    model_dir = tiny_model_dirs["qwen2"]
    new = spawn_engine("sglang", model_dir, tmp_path / "new", seed=11)
    old = spawn_engine("sglang", model_dir, tmp_path / "old", seed=12, base_gpu_id=0, fake_version="0.5.17")
    try:
        records = [engine_record(e.log_path) for e in (new, old)]
        assert [r["version"] for r in records] == ["0.5.23", "0.5.17"]
        assert [r["kwargs"]["base_gpu_id"] for r in records] == [1, 0]  # LOCAL_RANK by default
        assert [r["kwargs"]["random_seed"] for r in records] == [11, 12]
        for record in records:
            assert record["CUDA_VISIBLE_DEVICES"] == "3,5" and record["PYTORCH_CUDA_ALLOC_CONF"] is None
            assert record["torchrun_env"] == []
            assert record["kwargs"]["enable_memory_saver"] is True and record["kwargs"]["tp_size"] == 1
        assert records[0]["kwargs"]["nccl_port"] != records[1]["kwargs"]["nccl_port"]

        # 0.5.17 has no sessions in SGLang; the worker still holds callers to the contract's.
        assert old.update_weights_from_tensor([b"unused"]) == {"success": False, "message": NOT_IN_SESSION}
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        weights = [(name, p.detach().clone()) for name, p in reference.named_parameters()]
        old.update_weights(weights, weight_version="v17", bucket_bytes=2**30)
        assert old.get_weight_version() == "v17"  # read through tokenizer_manager.config_value
        assert old.generate([[1, 2, 3]], {"max_new_tokens": 2})[0]["weight_version"] == "v17"
    finally:
        new.shutdown()
        old.shutdown()


SCENARIOS = {
    "resume_unreleased": """
        print(engine.update_weights_from_tensor([b"x"], load_format="flattened_bucket"), flush=True)
        engine.resume_memory_occupation(["kv_cache"])
    """,
    "release_while_busy": """
        async def busy():
            task = asyncio.create_task(engine.async_generate(input_ids=[[1, 2]], sampling_params={
                "max_new_tokens": 400, "ignore_eos": True}))
            while not engine.tokenizer_manager.rid_to_state:
                await asyncio.sleep(0.01)
            await engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
        engine.loop.run_until_complete(busy())
    """,
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fake_dies_where_sglang_dies(scenario, tiny_model_dirs):
    """Driven directly (no worker in between): update outside a session is refused with SGLang's
    message; resuming an unreleased tag and releasing while busy take the whole process down."""
    script = textwrap.dedent("""
        import asyncio, sys
        import sglang
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput
        engine = sglang.Engine(model_path=sys.argv[1])
    """) + textwrap.dedent(SCENARIOS[scenario]) + "print('survived', flush=True)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES_DIR), PACKAGE_ROOT])}
    done = subprocess.run([sys.executable, "-c", script, str(tiny_model_dirs["qwen2"])], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout, done.stderr
    if scenario == "resume_unreleased":
        assert f"(False, '{NOT_IN_SESSION}')" in done.stdout
        assert "KeyError: 'kv_cache'" in done.stderr
    else:
        assert "AssertionError: release_memory_occupation should be called only when server is idle." in done.stderr
