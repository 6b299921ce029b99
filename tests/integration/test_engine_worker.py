"""A real engine worker process behind EngineClient: generation, weight sync, memory rules, and
what happens when either side of the pipe dies. References are Hugging Face forwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import rlrun
from rlrun.engine.client import EngineClient, EngineOpError
from rlrun.engine.rpc import RpcPeerDiedError, RpcRemoteError

pytestmark = pytest.mark.slow

PROMPTS = [[72, 101, 108, 108, 111, 33], [257, 9], [1, 2, 3, 4]]
SGLANG_NOT_IN_SESSION = ("update_weights_from_tensor must run between begin_weight_update() and "
                         "end_weight_update()")


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1:-1]
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def max_logprob_error(model, results, n: int, temperature: float) -> float:
    return max(
        (torch.tensor(r["output_logprobs"]) - hf_logprobs(model, PROMPTS[k // n], r["output_ids"], temperature))
        .abs().max().item()
        for k, r in enumerate(results)
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def wait_until_dead(pid: int, timeout_s: float) -> float:
    start = time.monotonic()
    while pid_alive(pid):
        if time.monotonic() - start > timeout_s:
            os.kill(pid, signal.SIGKILL)  # the test started this tree; do not leak it
            pytest.fail(f"engine worker {pid} still alive {timeout_s} s after its parent died")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture(scope="module")
def engine(tiny_model_dirs, tmp_path_factory):
    with EngineClient.spawn(backend="embedded", model_path=tiny_model_dirs["llama"],
                            run_dir=tmp_path_factory.mktemp("run"), rank=0, seed=7, request_timeout_s=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).eval()


def test_generate_groups_with_a_seed_match_hf_logprobs(engine, reference):
    params = {"max_new_tokens": 6, "temperature": 0.8, "n": 3, "sampling_seed": 11}
    results = engine.generate(PROMPTS, params)
    assert len(results) == 9
    for k, r in enumerate(results):
        assert r["prompt_tokens"] == len(PROMPTS[k // 3])
        assert r["completion_tokens"] == len(r["output_ids"]) == len(r["output_logprobs"])
        if r["finish_reason"]["type"] == "stop":
            assert r["output_ids"][-1] == r["finish_reason"]["matched"] and len(r["output_ids"]) <= 6
        else:
            assert r["finish_reason"] == {"type": "length", "length": 6} and len(r["output_ids"]) == 6
    assert [r["output_ids"] for r in engine.generate(PROMPTS, params)] == [r["output_ids"] for r in results]
    assert max_logprob_error(reference, results, n=3, temperature=0.8) < 1e-5


def test_weight_update_changes_logprobs_to_the_new_weights(engine, reference):
    g = torch.Generator().manual_seed(3)
    original = [(name, p.detach().clone()) for name, p in reference.named_parameters()]
    perturbed = [(name, t + 0.05 * torch.randn(t.shape, generator=g)) for name, t in original]
    target = AutoModelForCausalLM.from_config(reference.config).eval()
    target.load_state_dict(dict(perturbed), strict=False)  # tied: lm_head follows embed_tokens
    total_bytes = sum(t.numel() * t.element_size() for _, t in perturbed)
    try:
        stats = engine.update_weights(perturbed, weight_version="step-1", bucket_bytes=64 * 1024)
        assert stats["num_buckets"] > 1 and stats["num_bytes"] == total_bytes
        assert engine.get_weight_version() == "step-1"
        params = {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "sampling_seed": 5}
        results = engine.generate(PROMPTS, params)
        assert {r["weight_version"] for r in results} == {"step-1"}
        assert max_logprob_error(target, results, n=2, temperature=1.0) < 1e-5
        assert max_logprob_error(reference, results, n=2, temperature=1.0) > 1e-2  # the update did something
    finally:
        engine.update_weights(original, weight_version="restored", bucket_bytes=2**30)


def test_update_session_rules_and_load_errors_come_back_as_sglang_results(engine):
    assert engine.update_weights_from_tensor([b"unused"]) == {"success": False, "message": SGLANG_NOT_IN_SESSION}
    assert engine.end_weight_update()["success"] is False
    with pytest.raises(EngineOpError, match="weight model.nope must be a parameter"):
        engine.update_weights([("model.nope", torch.zeros(2))], weight_version="bad", bucket_bytes=1024)
    assert engine.health()["in_update_session"] is False  # the failed sync closed its session
    assert engine.get_weight_version() != "bad"


def test_release_resume_rules(engine):
    engine.release_memory_occupation()
    assert engine.health()["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(RpcRemoteError, match="generate must not run while memory tags"):
        engine.generate(PROMPTS, {"max_new_tokens": 2})
    engine.resume_memory_occupation(["weights"])
    with pytest.raises(RpcRemoteError, match=r"tags \['weights'\] must follow their release"):
        engine.resume_memory_occupation(["weights"])
    engine.resume_memory_occupation(["kv_cache", "cuda_graph"])
    assert len(engine.generate(PROMPTS, {"max_new_tokens": 2})) == 3


def test_killed_worker_fails_the_next_call_with_its_exit_code(tiny_model_dirs, tmp_path):
    client = EngineClient.spawn(backend="embedded", model_path=tiny_model_dirs["qwen2"], run_dir=tmp_path,
                                rank=1, seed=0, request_timeout_s=30)
    try:
        os.kill(client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RpcPeerDiedError, match=r"exited with code -9 \(killed by SIGKILL\); last lines of"):
            client.generate(PROMPTS, {"max_new_tokens": 2})
        assert time.monotonic() - start < 5
    finally:
        client.shutdown()
    client.shutdown()  # idempotent


def test_worker_dying_at_startup_is_reported_with_exit_code_and_log_tail(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(RpcPeerDiedError) as failure:
        EngineClient.spawn(backend="embedded", model_path=missing, run_dir=tmp_path, rank=2, seed=0,
                           startup_timeout_s=120)
    message = str(failure.value)
    assert "engine worker for rank 2 (embedded backend" in message and "did not start" in message
    assert "exited with code 1" in message and str(missing) in message.split("last lines of", 1)[1]


PACKAGE_ROOT = str(Path(rlrun.__file__).resolve().parents[1])
PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from rlrun.engine.client import EngineClient
    client = EngineClient.spawn(backend="embedded", model_path=sys.argv[1], run_dir=Path(sys.argv[2]), rank=0, seed=0)
    print(client.process.pid, flush=True)
    time.sleep(600)
""")


def test_worker_dies_when_its_parent_is_killed(tiny_model_dirs, tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_dirs["qwen2"]), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    try:
        worker_pid = int(parent.stdout.readline())
        assert pid_alive(worker_pid)
    finally:
        parent.kill()
        parent.wait()
    assert wait_until_dead(worker_pid, timeout_s=10) < 10


def test_watchdog_exits_when_parent_pid_dies_even_without_pdeathsig(tiny_model_dirs, tmp_path):
    """``--parent-pid`` names a process that is not the worker's real parent, so only the watchdog
    thread (not PR_SET_PDEATHSIG) can notice its death."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    log_path = tmp_path / "worker.log"
    with log_path.open("w") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "rlrun.engine.worker", "--endpoint", f"ipc://{tmp_path}/w.sock", "--backend",
             "embedded", "--model", str(tiny_model_dirs["qwen2"]), "--seed", "0", "--parent-pid", str(stand_in.pid)],
            stderr=log_file, env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
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
