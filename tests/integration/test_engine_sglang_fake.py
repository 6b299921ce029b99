"""The SGLang adapter's side of the contract that the shared suite cannot see: how it starts
``sglang.Engine`` (arguments and environment), SGLang 0.5.17's API, and that the fake really dies
where SGLang dies (which is why the worker refuses those calls up front).

The shared engine contract (every ``test_*`` of ``test_engine_worker.py``, which runs it over the
embedded backend and the 0.5.23 fake) runs here a second time over the fake in 0.5.17 mode: the
``engine`` fixture below replaces that module's, so one adapter is held to one contract on both
versions (docs/sglang-versions.md lists what differs)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_engine_worker
import torch
from test_engine_worker import reference  # noqa: F401  (a fixture of the contract tests below)
from transformers import AutoModelForCausalLM

import rlrun
from engine_contract import FAKES_DIR, spawn_engine
from rlrun.engine.backends.sglang import check_payload
from rlrun.engine.payload import serialize_flattened_bucket
from rlrun.runtime.processes import process_alive, process_tree

pytestmark = pytest.mark.slow

PACKAGE_ROOT = str(Path(rlrun.__file__).resolve().parents[1])
NOT_IN_SESSION = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"


globals().update({name: test for name, test in vars(test_engine_worker).items() if name.startswith("test_")})


@pytest.fixture(scope="module")
def engine(tiny_model_dirs, tmp_path_factory):
    """The contract tests' engine, here the SGLang worker over the fake in 0.5.17 mode."""
    with spawn_engine(
        "sglang",
        tiny_model_dirs["llama"],
        tmp_path_factory.mktemp("sglang-0.5.17"),
        request_timeout_s=120,
        fake_version="0.5.17",
    ) as client:
        yield client


def engine_record(log_path: Path) -> dict:
    """The fake's ``fake-sglang-engine {json}`` line: constructor kwargs and environment facts."""
    line = next(line for line in log_path.read_text().splitlines() if line.startswith("fake-sglang-engine "))
    return json.loads(line.split(" ", 1)[1])


def test_adapter_starts_sglang_as_the_contract_says_on_0_5_23_and_0_5_17(tiny_model_dirs, tmp_path, monkeypatch):
    for key, value in {
        "CUDA_VISIBLE_DEVICES": "3,5",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "LOCAL_RANK": "1",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_PORT": "29500",
    }.items():
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
        # SGLang's memory is held by the processes its Engine starts (scheduler, detokenizer): seen on the H200
        trees = [process_tree(e.process.pid) for e in (new, old)]
        assert all(len(tree) >= 2 for tree in trees), trees

        # 0.5.17 has no sessions in SGLang; the worker still holds callers to the contract's.
        assert old.update_weights_from_tensor([b"unused"]) == {"success": False, "message": NOT_IN_SESSION}
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        weights = [(name, p.detach().clone()) for name, p in hf_model.named_parameters()]
        old.update_weights(weights, weight_version="v17", bucket_bytes=2**30)
        assert old.get_weight_version() == "v17"  # read through tokenizer_manager.config_value
        assert old.generate([[1, 2, 3]], {"max_new_tokens": 2})[0]["weight_version"] == "v17"
        # Both versions drop the prefix cache (KV of the old weights) when a sync ends.
        new.update_weights(weights, weight_version="v23", bucket_bytes=2**30)
        for engine in (old, new):
            assert engine.log_path.read_text().count("fake-sglang-flush-cache") == 1
    finally:
        new.shutdown()
        old.shutdown()
    assert not [pid for tree in trees for pid in tree if process_alive(pid)], "shutdown left processes behind"


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
    script = (
        textwrap.dedent("""
        import asyncio, sys
        import sglang
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput
        engine = sglang.Engine(model_path=sys.argv[1])
    """)
        + textwrap.dedent(SCENARIOS[scenario])
        + "print('survived', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKES_DIR), PACKAGE_ROOT])}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_dirs["qwen2"])],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout, done.stderr
    if scenario == "resume_unreleased":
        assert f"(False, '{NOT_IN_SESSION}')" in done.stdout
        assert "KeyError: 'kv_cache'" in done.stderr
    else:
        assert "AssertionError: release_memory_occupation should be called only when server is idle." in done.stderr


def fake_unpickler(version: str, monkeypatch) -> type:
    """The fake's ``SafeUnpickler`` as the given version's wheel has it (its module reads the version at import)."""
    monkeypatch.setenv("FAKE_SGLANG_VERSION", version)
    spec = importlib.util.spec_from_file_location(f"fake_common_{version}", FAKES_DIR / "sglang/srt/utils/common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SafeUnpickler


def test_payloads_are_judged_by_the_installed_versions_unpickler(monkeypatch):
    """``check_payload`` asks the live unpickler, so each version's own rules apply: a real payload passes
    both; ``_codecs.encode`` (what protocol-2 pickles of bytes use) passes 0.5.23's exact list only;
    a torch helper outside 0.5.23's list passes 0.5.17's ``torch.`` prefix only."""
    exact, prefixed = fake_unpickler("0.5.23", monkeypatch), fake_unpickler("0.5.17", monkeypatch)
    assert hasattr(exact, "ALLOWED_GLOBALS") and hasattr(prefixed, "ALLOWED_MODULE_PREFIXES")
    payload = serialize_flattened_bucket([("w", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.zeros(2))])
    codecs_payload = pickle.dumps([b"\x01"], protocol=2)
    helper = io.BytesIO()
    pickle.Pickler(helper, protocol=4).dump(torch.nn.functional.relu)
    for unpickler in (exact, prefixed):
        check_payload(payload, unpickler)
    check_payload(codecs_payload, exact)
    with pytest.raises(
        ValueError,
        match=r"_codecs\.encode must be on the installed SGLang's unpickling allowlist .*"
        r"Blocked unsafe class loading",
    ):
        check_payload(codecs_payload, prefixed)
    check_payload(helper.getvalue(), prefixed)
    with pytest.raises(ValueError, match=r"torch\.nn\.functional\.relu .*Blocked unsafe global"):
        check_payload(helper.getvalue(), exact)


@pytest.mark.e2e  # the embedded backend's bench is in the main suite: tests/unit/test_bench.py
def test_bench_rollout_and_sync_run_both_backends_side_by_side(tmp_path):
    """``rlrun bench rollout|sync --backends embedded,sglang`` on CPU, the sglang
    worker over the 0.5.17 fake: one result per backend, full-length outputs, the bound's formula, the
    sync's bytes equal to the tiny model's parameter bytes (a parameter-count formula, float32), and its
    median and GB/s the formulas of its own timings."""
    from rlrun.tools.bench.shapes import SHAPES

    s = SHAPES["tiny"]
    attention = s.hidden * s.heads * s.head_dim * 2 + s.hidden * s.kv_heads * s.head_dim * 2 + 2 * s.head_dim
    weight_bytes = 4 * (
        s.vocab * s.hidden + s.layers * (attention + 3 * s.hidden * s.intermediate + 2 * s.hidden) + s.hidden
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "FAKE_SGLANG_VERSION": "0.5.17",
        "PYTHONPATH": os.pathsep.join([str(FAKES_DIR), PACKAGE_ROOT]),
    }
    batch, new_tokens = 2, 4
    records = {}
    for kind, args in {
        "rollout": [
            *("--batch", str(batch), "--prompt-len", "4", "--new-tokens", str(new_tokens), "--hbm-gbps", "1000"),
            *("--long-tail", "--long-tail-median", "3", "--long-tail-max", "6"),
        ],
        "sync": ["--repeats", "2", "--bucket-mib", "1"],
    }.items():
        out = tmp_path / f"{kind}.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "rlrun",
                "bench",
                kind,
                "--shape",
                "tiny",
                "--backends",
                "embedded,sglang",
                "--run-dir",
                str(tmp_path / "run"),
                "--out",
                str(out),
                *args,
            ],
            check=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
            capture_output=True,
        )
        records[kind] = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in records["rollout"]] == ["embedded", "sglang"]
    for r in records["rollout"]:
        assert r["engine"]["output_tokens"] == r["engine_sampled"]["output_tokens"] == batch * new_tokens
        for cell in ("engine", "engine_sampled"):  # the median of three timed calls
            assert len(r[cell]["repeats_s"]) == 3 and r[cell]["seconds"] == sorted(r[cell]["repeats_s"])[1]
        kv = s.layers * 2 * s.kv_heads * s.head_dim * 4 * batch * (4 + (new_tokens - 1) / 2)  # K, V at the mean context
        assert r["bound"]["tokens_per_s"] == pytest.approx(batch / ((weight_bytes + kv) / 1e12))
        tail = r["long_tail"]  # 4 requests per slot, lengths drawn once for both backends
        assert tail["num_requests"] == 4 * batch
        for run in ("throughput", "in_batches"):  # refilled slots, and calls of `batch` requests one after another
            assert 0 < tail[run]["output_tokens"] <= tail["max_new_tokens_sum"]
    assert len({r["long_tail"]["max_new_tokens_sum"] for r in records["rollout"]}) == 1
    assert [(r["backend"], r["weight_bytes"]) for r in records["sync"]] == [
        ("embedded", weight_bytes),
        ("sglang", weight_bytes),
    ]
    for r in records["sync"]:  # tied: the embedding is sent once; one 1 MiB bucket holds the tiny model
        assert r["shape"] == "tiny" and r["num_buckets"] == 1 and len(r["seconds"]) == len(r["probe_s"]) == 2
        assert r["median_s"] == pytest.approx(statistics.median(r["seconds"]))
        assert r["gb_per_s"] == pytest.approx(weight_bytes / r["median_s"] / 1e9)
