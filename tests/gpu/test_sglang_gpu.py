"""The SGLang backend against a real ``sglang`` (0.5.17 on our H200) through rlrun's own EngineClient,
worker and RPC: generation with log-probs, weight sync from a Megatron model over CUDA IPC, the
trainer-vs-engine log-prob gap, release/resume in the documented order, pause/abort, clean shutdown.

References are independent of the code under test: the Megatron trainer's own forward for log-probs
(built from the same random HF directory), the driver's free-memory count (``torch.cuda.mem_get_info``)
for memory, ``/proc`` for processes. Every figure also goes to a JSON file (``$SGLANG_GPU_JSON``, else
``$OUT/sglang_gpu_suite.json`` when ``$OUT`` is set), written as the module ends.

Run on the GPU machine (scripts/gpu/sglang_session.md):  python -m pytest -q -s tests/gpu/test_sglang_gpu.py
``RLRUN_SGLANG_SUITE_ON_FAKE=1`` runs the same code on CPU against the fake sglang (tests/fakes) with a
tiny model, to check the suite itself before spending device time; memory checks are skipped there
(``--noconftest``: tests/conftest.py skips everything under tests/gpu without CUDA):
``RLRUN_SGLANG_SUITE_ON_FAKE=1 python -m pytest --noconftest -p no:cacheprovider tests/gpu/test_sglang_gpu.py``
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from rlrun.runtime.processes import process_alive, process_tree
from rlrun.tools.bench.engines import SGLANG_SERVER_ARGS

ON_FAKE = os.environ.get("RLRUN_SGLANG_SUITE_ON_FAKE") == "1"
pytestmark = pytest.mark.slow if ON_FAKE else pytest.mark.gpu
if not ON_FAKE and not (torch.cuda.is_available() and importlib.util.find_spec("sglang")):
    pytest.skip("needs CUDA and sglang (see scripts/gpu/sglang_session.md)", allow_module_level=True)

SHAPE = "tiny" if ON_FAKE else "qwen3-0.6b"
DTYPE = "float32" if ON_FAKE else "bfloat16"
GAP_GOAL = 0.01
"""Mean |trainer - engine| log-prob of the sampled tokens (bf16)."""
SERVER_ARGS = {**SGLANG_SERVER_ARGS, **json.loads(os.environ.get("RLRUN_SGLANG_EXTRA_SERVER_ARGS", "{}"))}
"""The benchmarks' server args (KV budget from 30% of the device, which the trainer shares; no FlashInfer
JIT; token ids only). ``RLRUN_SGLANG_EXTRA_SERVER_ARGS`` (JSON) adds to them, e.g.
``{"disable_cuda_graph": true}`` if the engine does not start with CUDA graphs."""
PROMPT_LEN, NEW_TOKENS, BATCH = 32, 64, 8
SAMPLED = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
BUCKET_BYTES = 64 * 2**10 if ON_FAKE else 256 * 2**20
"""Small enough for several buckets (the tiny model is 0.2 MB, the 0.6B one 1.2 GB in bf16)."""
GB = 1e9


def used_gb() -> float:
    """Device memory in use by every process (the driver's count), or NaN without CUDA."""
    if not torch.cuda.is_available():
        return math.nan
    free, total = torch.cuda.mem_get_info()
    return (total - free) / GB


@pytest.fixture(scope="module")
def record():
    """The suite's figures, written to JSON when the module ends (also after a failure)."""
    results: dict = {"shape": SHAPE, "dtype": DTYPE, "on_fake": ON_FAKE, "memory_gb": {}, "seconds": {}}
    if torch.cuda.is_available():
        results["gpu"] = torch.cuda.get_device_name(0)
    yield results
    target = os.environ.get("SGLANG_GPU_JSON") or (
        os.environ.get("OUT") and f"{os.environ['OUT']}/sglang_gpu_suite.json"
    )
    if target:
        Path(target).write_text(json.dumps(results, indent=1, default=str))


@pytest.fixture(scope="module")
def parallel():
    from rlrun.runtime.dist import destroy_distributed, init_distributed

    yield init_distributed(tp=1, pp=1, seed=0)
    destroy_distributed()


@pytest.fixture(scope="module")
def model_dir(parallel, tmp_path_factory) -> Path:
    from rlrun.tools.bench.shapes import get_shape, write_random_model

    path = write_random_model(
        get_shape(SHAPE), tmp_path_factory.mktemp("model"), getattr(torch, DTYPE), str(parallel.device)
    )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory, record):
    """Started before the trainer allocates (SGLang sizes its KV cache from free memory), memory saver on."""
    from rlrun.engine.client import EngineClient
    from rlrun.engine.registry import BackendSpec

    extra_env = {}
    if ON_FAKE:
        fakes = str(Path(__file__).parents[1] / "fakes")
        extra_env = {"PYTHONPATH": os.pathsep.join(p for p in (fakes, os.environ.get("PYTHONPATH")) if p)}
    record["memory_gb"]["before_engine"] = used_gb()
    start = time.perf_counter()
    spec = BackendSpec(
        "sglang", str(model_dir), 0, DTYPE, base_gpu_id=0, enable_memory_saver=True, server_args=dict(SERVER_ARGS)
    )
    client = EngineClient.spawn(
        spec,
        run_dir=tmp_path_factory.mktemp("engine"),
        rank=0,
        startup_timeout_s=600,
        request_timeout_s=300,
        extra_env=extra_env,
    )
    record["seconds"]["engine_start"] = time.perf_counter() - start
    record["memory_gb"]["after_engine_start"] = used_gb()
    record["engine_log"] = str(client.log_path)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def trainer(engine, model_dir, parallel):
    from rlrun.megatron import build_model

    return build_model(str(model_dir), parallel, dtype=DTYPE)


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 500, (BATCH, PROMPT_LEN), generator=g).tolist()


def trainer_logprobs(trainer, prompt_ids: list[list[int]], results: list[dict]) -> torch.Tensor:
    """The Megatron trainer's log p(response token | prefix) at temperature 1, ``[B, NEW_TOKENS]`` float32."""
    from rlrun.megatron import compute_logprobs

    rows = [p + r["output_ids"] for p, r in zip(prompt_ids, results, strict=False)]
    tokens = torch.tensor(rows, device=trainer.parallel.device)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        logprobs = compute_logprobs(trainer, tokens, positions, 1.0).float()
    return logprobs[:, PROMPT_LEN - 1 :].cpu()


def gap(trainer, engine, seed: int, version: str) -> tuple[float, float, torch.Tensor, list]:
    """(mean, max) |trainer - engine| log-prob over BATCH sampled responses, the trainer's log-probs, the prompts."""
    prompt_ids = prompts(seed)
    results = engine.generate(prompt_ids, {**SAMPLED, "sampling_seed": seed})
    assert {r["weight_version"] for r in results} == {version}
    for r in results:
        assert len(r["output_ids"]) == len(r["output_logprobs"]) == r["completion_tokens"] == NEW_TOKENS
    engine_lp = torch.tensor([r["output_logprobs"] for r in results])
    trainer_lp = trainer_logprobs(trainer, prompt_ids, results)
    diff = (trainer_lp - engine_lp).abs()
    return diff.mean().item(), diff.max().item(), trainer_lp, (prompt_ids, results)


def test_generated_logprobs_match_the_trainer_on_the_same_weights(engine, trainer, record):
    """Both loaded the same HF directory: the engine's log-probs of its own samples are the trainer's."""
    start = time.perf_counter()
    mean, worst, _, _ = gap(trainer, engine, seed=1, version=engine.get_weight_version())
    record["seconds"]["generate_8x64"] = time.perf_counter() - start
    record["gap_initial"] = {"mean_abs": mean, "max_abs": worst}
    assert mean <= GAP_GOAL, f"trainer-vs-engine mean |log-prob gap| {mean:.4f} > goal {GAP_GOAL}"


def test_score_tokens_match_the_trainer(engine, trainer, record):
    """``algorithm.opd.teacher_engine: sglang``'s call (prefill-only requests with ``logprob_start_len``):
    the engine's prompt log-probs of sampled responses are the trainer's on the same weights, at T = 1. At
    T = 0.7 it only records which of the trainer's T = 0.7 / T = 1 log-probs they match (whether SGLang
    scales prompt log-probs by the temperature, the one reason rlrun asks an SGLang teacher for T = 1 only)."""
    _, _, trainer_lp, (prompt_ids, results) = gap(trainer, engine, seed=3, version=engine.get_weight_version())
    sequences = [p + r["output_ids"] for p, r in zip(prompt_ids, results, strict=True)]
    scored = torch.tensor(engine.score_tokens(sequences, [PROMPT_LEN] * BATCH, 1.0))
    diff = (scored - trainer_lp).abs()
    record["score_tokens_gap"] = {"mean_abs": diff.mean().item(), "max_abs": diff.max().item()}
    assert diff.mean().item() <= GAP_GOAL, record["score_tokens_gap"]
    from rlrun.megatron import compute_logprobs

    tokens = torch.tensor(sequences, device=trainer.parallel.device)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with torch.no_grad():
        cool = compute_logprobs(trainer, tokens, positions, 0.7).float()[:, PROMPT_LEN - 1 :].cpu()
    scored_cool = torch.tensor(engine.score_tokens(sequences, [PROMPT_LEN] * BATCH, 0.7))
    record["score_tokens_at_0_7"] = {
        "mean_abs_vs_trainer_t0_7": (scored_cool - cool).abs().mean().item(),
        "mean_abs_vs_trainer_t1": (scored_cool - trainer_lp).abs().mean().item(),
    }


def test_weight_sync_from_megatron_moves_the_engine_to_the_trainers_weights(engine, trainer, record):
    """Perturb the trainer, push it over CUDA IPC in flattened buckets: the engine follows, stamped."""
    from rlrun.megatron import export_hf_weights

    g = torch.Generator(device=trainer.parallel.device).manual_seed(5)
    originals = [param.detach().cpu().clone() for param in trainer.module.parameters()]
    try:
        with torch.no_grad():  # fresh matrices of the same scale: adding noise on top grew the activations,
            for param in trainer.module.parameters():  # and the bf16 gap with them (seen: 0.017 on the GPU)
                if param.dim() >= 2:
                    noise = torch.randn(param.shape, generator=g, device=param.device, dtype=torch.float32)
                    param.copy_((param.float().std() * noise).to(param.dtype))
        stats = engine.update_weights(export_hf_weights(trainer), weight_version="synced-1", bucket_bytes=BUCKET_BYTES)
        record["sync"] = {**stats, "gb_per_s": stats["num_bytes"] / stats["seconds"] / GB}
        assert engine.get_weight_version() == "synced-1"
        mean, worst, trainer_lp, (prompt_ids, results) = gap(trainer, engine, seed=2, version="synced-1")
        record["gap_after_sync"] = {"mean_abs": mean, "max_abs": worst}
        assert stats["num_buckets"] >= 2 and mean <= GAP_GOAL, (stats, mean)
    finally:
        with torch.no_grad():  # the next test syncs the unperturbed weights back to the engine
            for param, original in zip(trainer.module.parameters(), originals, strict=False):
                param.copy_(original.to(param.device))
    # the perturbation mattered: the unperturbed trainer scores the same tokens differently
    moved = (trainer_logprobs(trainer, prompt_ids, results) - trainer_lp).abs().mean().item()
    record["perturbation_moved_logprobs_by"] = moved
    assert moved >= 5 * mean, f"the perturbation moved the trainer's log-probs by {moved:.4f}, the gap is {mean:.4f}"


def test_release_and_resume_in_the_documented_order(engine, trainer, record):
    """release all -> (trainer works) -> resume weights -> sync -> resume kv_cache + cuda_graph -> generate.
    Without the sync the resumed weights would be garbage (no CPU backup), so the gap checks it."""
    from rlrun.megatron import export_hf_weights

    mem, secs = record["memory_gb"], record["seconds"]
    mem["before_release"] = used_gb()
    for step, call in [
        ("release_all", lambda: engine.release_memory_occupation()),
        ("resume_weights", lambda: engine.resume_memory_occupation(["weights"])),
        (
            "sync_after_resume",
            lambda: engine.update_weights(
                export_hf_weights(trainer), weight_version="after-resume", bucket_bytes=BUCKET_BYTES
            ),
        ),
        ("resume_kv_cache_cuda_graph", lambda: engine.resume_memory_occupation(["kv_cache", "cuda_graph"])),
    ]:
        start = time.perf_counter()
        call()
        secs[step] = time.perf_counter() - start
        mem[f"after_{step}"] = used_gb()
    mean, worst, _, _ = gap(trainer, engine, seed=3, version="after-resume")
    record["gap_after_resume"] = {"mean_abs": mean, "max_abs": worst}
    assert mean <= GAP_GOAL
    if torch.cuda.is_available():
        weights_gb = sum(p.numel() * p.element_size() for p in trainer.module.parameters()) / GB
        freed = mem["before_release"] - mem["after_release_all"]
        assert freed >= 0.9 * weights_gb, f"release gave back {freed:.2f} GB, less than the weights' {weights_gb:.2f}"
        assert mem["after_resume_weights"] - mem["after_release_all"] >= 0.9 * weights_gb
        assert abs(mem["after_resume_kv_cache_cuda_graph"] - mem["before_release"]) <= 0.1 * freed + 0.5


def test_pause_abort_returns_partial_output_and_continue_serves_again(engine, record):
    out: dict = {}
    long = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}
    thread = threading.Thread(target=lambda: out.update(result=engine.generate(prompts(4)[:2], long)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while engine.health()["num_inflight"] == 0:
        assert time.monotonic() < deadline and thread.is_alive(), "the long generate never became in flight"
        time.sleep(0.02)
    time.sleep(0.5)  # some tokens decoded
    start = time.perf_counter()
    engine.pause_generation("abort")
    record["seconds"]["pause_abort"] = time.perf_counter() - start
    thread.join(timeout=60)
    results = out["result"]
    record["aborted_lengths"] = [len(r["output_ids"]) for r in results]
    for r in results:
        assert r["finish_reason"]["type"] == "abort" and 0 < len(r["output_ids"]) < 3000
        assert len(r["output_logprobs"]) == len(r["output_ids"])
    engine.continue_generation()
    again = engine.generate(prompts(5)[:1], {"max_new_tokens": 4, "ignore_eos": True})
    assert again[0]["finish_reason"] == {"type": "length", "length": 4}


def test_shutdown_leaves_no_process_and_gives_the_memory_back(engine, trainer, record):
    """The worker exits on its own after ``shutdown`` (no kill needed), with every process SGLang started,
    and the device gets back what the engine held (polled: it is not free the moment shutdown returns)."""
    tree = process_tree(engine.process.pid)
    record["engine_processes"] = len(tree)
    held = record["memory_gb"]["after_engine_start"] - record["memory_gb"]["before_engine"]
    before = used_gb()
    start = time.perf_counter()
    engine.rpc.call("shutdown", timeout_s=30)
    engine.process.wait(timeout=90)
    record["seconds"]["shutdown"] = time.perf_counter() - start
    record["worker_exit_code"] = engine.process.returncode
    deadline = time.monotonic() + 60
    while any(process_alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in tree if process_alive(pid)]
    engine.shutdown()  # closes the client's socket; kills the group if anything was left
    assert engine.process.returncode == 0 and not left, (engine.process.returncode, left)
    if torch.cuda.is_available():
        while before - used_gb() < 0.9 * held and time.monotonic() < deadline:
            time.sleep(0.2)
        record["memory_gb"]["after_shutdown"] = used_gb()
        record["seconds"]["memory_free_after_shutdown"] = time.perf_counter() - start
        assert before - used_gb() >= 0.9 * held, (
            f"engine held {held:.2f} GB, shutdown gave back {before - used_gb():.2f}"
        )
