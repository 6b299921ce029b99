"""The offloader's per-process GPU memory query: NVML's answer summed per process over the GPUs and
grouped by name. NVML cannot run here, so a fake ``pynvml`` with NVML's call names and process records
stands in for it; the real one runs in the H200 benchmarks (``memory/<phase>/*_gb``)."""

from __future__ import annotations

import math
import sys
import types

import pytest

from rlrun.trainer import offload


class Proc:
    def __init__(self, pid: int, used: int | None) -> None:
        self.pid, self.usedGpuMemory = pid, used


def fake_pynvml(devices: list[list[Proc]]) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = type("NVMLError", (Exception,), {})
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetCount = lambda: len(devices)
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: devices[handle]
    return module


@pytest.fixture
def nvml(monkeypatch):
    def install(devices):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(devices))
        offload._nvml.cache_clear()

    yield install
    offload._nvml.cache_clear()


def test_memory_is_summed_per_process_over_gpus_and_grouped(nvml):
    gib = 2**30
    nvml([[Proc(10, 2 * gib), Proc(11, gib)], [Proc(11, 3 * gib), Proc(12, None)]])
    assert offload.gpu_gb_by_pid() == {10: 2 * gib / 1e9, 11: 4 * gib / 1e9}
    totals = offload.process_gpu_gb({"trainer": [10], "engine": [11, 12, 13], "gone": [99]})
    assert totals["trainer"] == round(2 * gib / 1e9, 3)
    assert totals["engine"] == round(4 * gib / 1e9, 3)  # 12's memory withheld, 13 holds none
    assert math.isnan(totals["gone"])


def test_nvml_that_fails_to_start_falls_back_to_nvidia_smi(nvml, monkeypatch):
    nvml([])
    pynvml = sys.modules["pynvml"]

    def init():
        raise pynvml.NVMLError("NVML Shared Library Not Found")

    pynvml.nvmlInit = init
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd[0])
        return types.SimpleNamespace(stdout="10, 2048\n[N/A], 5\n")

    monkeypatch.setattr(offload.subprocess, "run", run)
    assert offload.gpu_gb_by_pid() == {10: 2048 * 2**20 / 1e9}
    assert calls == ["nvidia-smi"]
