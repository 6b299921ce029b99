"""Shared helpers of the engine tests: spawning either backend, HF references, process checks.

The SGLang backend runs against the fake ``sglang`` package in ``tests/fakes`` (0.5.23's API and
failure modes around a real CPU model), which only the spawned worker can import: its directory is
put on the worker's PYTHONPATH, never on the test process's.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rlrun.engine.client import EngineClient
from rlrun.engine.registry import BackendSpec

FAKES_DIR = Path(__file__).parent / "fakes"
BACKENDS = ("embedded", "sglang")


def spawn_engine(
    backend: str,
    model_dir: Path,
    run_dir: Path,
    *,
    rank: int = 0,
    seed: int = 7,
    fake_version: str = "0.5.23",
    **kwargs,
) -> EngineClient:
    """A worker for ``backend``; ``sglang`` means the fake, set up as production would use SGLang:
    memory saver on, and deterministic inference so that ``sampling_seed`` is honoured."""
    if backend == "sglang":
        kwargs.setdefault("enable_memory_saver", True)
        kwargs.setdefault("server_args", {"enable_deterministic_inference": True})
        pythonpath = os.pathsep.join(p for p in (str(FAKES_DIR), os.environ.get("PYTHONPATH")) if p)
        kwargs["extra_env"] = {
            "PYTHONPATH": pythonpath,
            "FAKE_SGLANG_VERSION": fake_version,
            **kwargs.get("extra_env", {}),
        }
    spec_keys = ("enable_memory_saver", "server_args", "dtype", "tp_size", "base_gpu_id")
    spec_fields = {k: kwargs.pop(k) for k in spec_keys if k in kwargs}
    spec = BackendSpec(backend, str(model_dir), seed, **spec_fields)
    return EngineClient.spawn(spec, run_dir=run_dir, rank=rank, **kwargs)


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, from one unpadded forward over prompt + response (on CPU)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], device=model.device)).logits[0].float().cpu()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def wait_until_dead(pid: int, timeout_s: float) -> float:
    """Seconds until ``pid`` is gone; fails the test (after killing it: the test started it) if it lingers."""
    start = time.monotonic()
    while pid_alive(pid):
        if time.monotonic() - start > timeout_s:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"process {pid} still alive {timeout_s} s after it should have died")
        time.sleep(0.05)
    return time.monotonic() - start


def wait_for_inflight(engine: EngineClient, call: dict | None = None, timeout_s: float = 60) -> None:
    """Block until the worker reports a generate request in flight (asked over the same RPC).
    ``call`` is the outcome dict of the background call, checked so that its failure shows at once."""
    deadline = time.monotonic() + timeout_s
    while engine.health()["num_inflight"] == 0:
        if call:
            pytest.fail(f"the background generate ended before it was seen in flight: {call}")
        assert time.monotonic() < deadline, "the generate request never became in flight"
        time.sleep(0.02)
