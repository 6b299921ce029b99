"""``rlrun bench rollout --profile``: where the time of one embedded-engine decode step goes.

The benchmark's sampled call (temperature 1, top-p 0.95, seeded, every row full length) is admitted and stepped
forward by forward (``DecodeRun.forward``, what the engine's loop runs between its host looks) to a window of
``2 * steps + 1`` forwards that all read one bucket of cache columns, from the middle of the response on. The
window's first forward is untimed (on a fresh engine it captures the bucket's CUDA graph), then two views:

1. ``steps`` forwards under the torch profiler: the kernel-time table (:mod:`rlrun.tools.bench.kernel_table`, shared
   with ``bench train --profile``), the busy fraction (kernel time / wall time of those steps), kernels per step,
   and kernel time per step by category of kernel name (:func:`category`). On CPU the same from the ops: their
   self CPU time and their names.
2. ``steps`` forwards without the profiler, a CUDA event recorded before and after each: the device's time per
   step (around one replay) and its idle time between consecutive steps (``host_gap_s_per_step``, the end of one
   step to the start of the next: the device waiting for the host), next to the host's time to issue a step.

A step must read every weight once and, in every slot, the K/V of the columns it reads: ``hbm_bytes_per_step``;
``bound_step_s`` is those bytes at the HBM bandwidth (the bound the step time is compared with).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from pathlib import Path

import torch

from rlrun.tools.bench.kernel_table import profiled, write_kernel_table
from rlrun.tools.bench.timing import timer

CATEGORIES = ("attention", "gemm", "sampling", "other")
_PATTERNS = (
    ("attention", re.compile(r"attention|fmha|flash", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cublas|cutlass|xmma|splitk|aten::(mm|addmm|bmm|matmul|linear)$", re.I)),
    (
        "sampling",
        re.compile(
            r"softmax|sort|topk|radix|scan|cumsum|searchsorted|argmax|exp_kernel|log_kernel|aten::(exp|log)$", re.I
        ),
    ),
)
"""Checked in this order (the attention kernel's name also says cutlass). ``sampling`` is softmax, log-softmax,
exp/log, top-k, sorts, scans (cumsum) and argmax; the sampler's divisions, masks and noise are ``other``."""


def category(name: str) -> str:
    """The :data:`CATEGORIES` entry of a kernel (or CPU op) name."""
    return next((c for c, pattern in _PATTERNS if pattern.search(name)), "other")


@dataclasses.dataclass(frozen=True)
class DecodeProfile:
    """One read bucket's decode steps, profiled (view 1) and timed with CUDA events (view 2)."""

    table: str
    """Path of the kernel-time table (top kernels by device time; CPU: ops by self CPU time)."""
    num_slots: int
    read_len: int
    """Cache columns every profiled step reads."""
    first_forward: int
    """The window's first timed forward (1 = the one after the prefill)."""
    steps: int
    """Decode steps profiled (and as many timed with events)."""
    mean_step_s: float
    """Wall time of the profiled steps / steps (profiler overhead included)."""
    busy_s_per_step: float
    """Kernel time per step (CPU: op self time): the sum of ``category_s_per_step``."""
    busy_fraction: float
    """``busy_s_per_step / mean_step_s``: how much of the window the GPU (CPU: an op) was running."""
    launches_per_step: float
    """Kernels, copies and memsets per step (CPU: ops)."""
    category_s_per_step: dict[str, float]
    """Per :data:`CATEGORIES` entry, its kernels' time per step."""
    weight_bytes: int
    kv_bytes_per_step: int
    """K/V of ``read_len`` columns in every slot and layer (padding and ended slots are read too); where the engine
    attends by key counts (CUDA), each row reads only its own filled columns, so this bounds what is read."""
    hbm_bytes_per_step: int
    bound_step_s: float
    """``hbm_bytes_per_step / hbm_bytes_per_s``."""
    host_issue_s_per_step: float
    """Host time to issue one step (``DecodeRun.forward``: Python plus the graph launch), without waiting."""
    wall_s_per_step: float
    """Wall clock from the first step's issue to the device being done with the last, per step (no profiler)."""
    device_s_per_step: float | None
    """CUDA events around each replay (None on CPU, where the host runs the step itself)."""
    host_gap_s_per_step: float | None
    """Device idle between the end of one step and the start of the next, waiting for the host (None on CPU);
    about ``wall_s_per_step - device_s_per_step``."""
    fraction_of_bound: float | None
    """``bound_step_s / device_s_per_step`` (None on CPU)."""


def _busy(prof, device: torch.device) -> tuple[dict[str, float], int]:
    """Seconds by category and the count of device activities (CUDA: kernels, copies, memsets; CPU: ops)."""
    from torch.autograd import DeviceType

    seconds = dict.fromkeys(CATEGORIES, 0.0)
    count = 0
    kind = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    for event in prof.events():
        if event.device_type != kind or getattr(event, "is_user_annotation", False):  # ranges, not work
            continue
        micros = event.time_range.elapsed_us() if kind == DeviceType.CUDA else event.self_cpu_time_total
        seconds[category(event.name)] += micros / 1e6
        count += 1
    return seconds, count


def _window_start(run, first: int, span: int) -> int:
    """The first forward, from ``first`` on, of ``span`` consecutive forwards that read one bucket (the read
    length stops growing once every row has its max_new_tokens, so there is one)."""
    while run.read_len_at(first) != run.read_len_at(first + span - 1):
        first += 1
    return first


def _event_times(run, steps: int, device: torch.device) -> tuple[float, float, float | None, float | None]:
    """Per step: (host seconds to issue it, wall-clock seconds until the device is done, device seconds, device
    idle seconds before the next step); the last two None on CPU."""
    if device.type != "cuda":
        with timer(device) as wall:
            for _ in range(steps):
                run.forward()
        return wall[0] / steps, wall[0] / steps, None, None
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for before, after in marks:
        before.record()
        run.forward()
        after.record()
    issued = time.perf_counter() - start
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    device_s = statistics.fmean(b.elapsed_time(a) for b, a in marks) / 1e3
    gaps = [marks[k][1].elapsed_time(marks[k + 1][0]) / 1e3 for k in range(steps - 1)]
    return issued / steps, wall / steps, device_s, statistics.fmean(gaps) if gaps else 0.0


def profile_decode(
    engine, prompts: list[list[int]], params: dict, new_tokens: int, table: Path, hbm_bytes_per_s: float, steps: int = 8
) -> DecodeProfile:
    """Profile ``steps`` decode steps of one call of ``prompts`` (module docstring); writes the table at ``table``."""
    device = engine.device
    with torch.inference_mode():
        run = engine.decode_run(prompts, {**params, "max_new_tokens": new_tokens, "ignore_eos": True})
        run.look(run.request.aborted)  # admits every row it has slots for: one prefill, first tokens
        start = _window_start(run, max(1, new_tokens // 2), 2 * steps + 1)
        while run.forwards < start:  # the window's untimed first forward included
            run.forward()
        wall: list[float] = []

        def window() -> None:
            with timer(device) as seconds:
                lengths = {run.forward() for _ in range(steps)}
            assert len(lengths) == 1, lengths  # _window_start chose forwards of one bucket
            wall.extend(seconds)

        prof = profiled(window)
        host_issue_s, wall_s, device_s, gap_s = _event_times(run, steps, device)
    write_kernel_table(prof, table)
    by_category, launches = _busy(prof, device)
    length = run.read_len_at(run.forwards)
    cache = run.batch.cache
    kv_bytes = sum(t.shape[0] * t.shape[1] * length * t.shape[3] * t.element_size() for t in cache.keys + cache.values)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    step_s, busy_s = wall[0] / steps, sum(by_category.values()) / steps
    bound_s = (weights + kv_bytes) / hbm_bytes_per_s
    return DecodeProfile(
        table=str(table),
        num_slots=run.shape.num_rows,
        read_len=length,
        first_forward=start + 1,
        steps=steps,
        mean_step_s=step_s,
        busy_s_per_step=busy_s,
        busy_fraction=busy_s / step_s,
        launches_per_step=launches / steps,
        category_s_per_step={name: s / steps for name, s in by_category.items()},
        weight_bytes=weights,
        kv_bytes_per_step=kv_bytes,
        hbm_bytes_per_step=weights + kv_bytes,
        bound_step_s=bound_s,
        host_issue_s_per_step=host_issue_s,
        wall_s_per_step=wall_s,
        device_s_per_step=device_s,
        host_gap_s_per_step=gap_s,
        fraction_of_bound=None if device_s is None else bound_s / device_s,
    )
