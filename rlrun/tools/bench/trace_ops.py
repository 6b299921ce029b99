"""Top ops of one loop phase in a torch profiler Chrome trace (``rlrun bench step --profile-step K``).

The loop's profiler (rlrun/observability/profiler.py, ``logging.profile_steps``) records a whole step of the trainer
process and writes a Chrome trace; every phase is a ``record_function`` range named after it
(rlrun/observability/metrics.py PhaseTimer). This module reads that file back and builds the table
``prof.key_averages()`` would print, restricted to one phase's ranges:

* CPU: every ``cpu_op`` inside the phase, grouped by name: calls, inclusive and self microseconds
  (self = its duration less that of the ops nested directly in it, per thread);
* device: every GPU kernel, memcpy and memset charged to the op that launched it (the trace links them
  by ``External id``), i.e. key_averages' self device time; kernels are also listed by kernel name.

Rows are sorted by device time, then CPU self time, so on CPU (no kernels) the table is by CPU self time.
The engine generates in its own process, which this trace does not see: the rollout phase's rows are the
trainer waiting for it.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One op (or kernel) name's totals within the phase, in microseconds."""

    name: str
    calls: int
    device_us: float
    cpu_self_us: float
    cpu_total_us: float


@dataclasses.dataclass(frozen=True)
class PhaseProfile:
    """The top ops of one phase of one profiled step."""

    phase: str
    step: int
    trace: str
    phase_us: float
    """Summed duration of the phase's ranges in the trace (the profiled step runs slower than the others)."""
    device_us: float
    """All device time charged to ops of the phase."""
    ops: list[OpRow]
    kernels: list[OpRow]
    """Device time by kernel name (``cpu_*`` columns 0)."""


def phase_ranges(events: list[dict], phase: str) -> list[tuple[float, float]]:
    """(start, end) microseconds of every ``record_function(phase)`` range."""
    return [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name") == phase and e.get("ph") == "X"
    ]


def _inside(event: dict, ranges: list[tuple[float, float]]) -> bool:
    return any(start <= event["ts"] and event["ts"] + event["dur"] <= end for start, end in ranges)


def self_times(ops: list[dict]) -> list[float | None]:
    """Each op's duration less its direct children's (ops of the same thread nested inside it); None for an
    op nested directly in one of the same name (``aten::sum`` calling ``aten::sum``), which is part of its
    parent, as in torch's own event list."""
    order = sorted(range(len(ops)), key=lambda i: (ops[i]["pid"], ops[i]["tid"], ops[i]["ts"], -ops[i]["dur"]))
    own: list[float | None] = [float(op["dur"]) for op in ops]
    stack: list[int] = []
    for i in order:
        op = ops[i]
        while stack and not (
            ops[stack[-1]]["pid"] == op["pid"]
            and ops[stack[-1]]["tid"] == op["tid"]
            and op["ts"] + op["dur"] <= ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"]
        ):
            stack.pop()
        if stack and ops[stack[-1]]["name"] == op["name"]:
            own[i] = None  # its children nest under the parent on the stack
            continue
        if stack:
            own[stack[-1]] -= op["dur"]
        stack.append(i)
    return own


def _rows(totals: dict[str, list[float]], top: int) -> list[OpRow]:
    rows = [
        OpRow(name, int(calls), round(device, 1), round(cpu_self, 1), round(cpu_total, 1))
        for name, (calls, device, cpu_self, cpu_total) in totals.items()
    ]
    return sorted(rows, key=lambda r: (-r.device_us, -r.cpu_self_us))[:top]


def phase_profile(trace: Path, phase: str, step: int, top: int = 25) -> PhaseProfile:
    """The ``top`` ops and kernels of ``phase`` in ``trace`` (module docstring)."""
    events = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    ranges = phase_ranges(events, phase)
    if not ranges:
        raise ValueError(
            f"the trace {trace} must hold a record_function range named {phase!r} because the "
            f"table is of that phase; open the trace to see which phases the profiled step ran"
        )
    ops = [e for e in events if e.get("cat") == "cpu_op" and _inside(e, ranges)]
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    launcher = {}
    for op, own in zip(ops, self_times(ops), strict=False):
        if "External id" in op.get("args", {}):
            launcher[op["args"]["External id"]] = op["name"]
        if own is None:
            continue
        row = by_op[op["name"]]
        row[0] += 1
        row[2] += own
        row[3] += op["dur"]
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for kernel in (e for e in events if e.get("cat") in DEVICE_CATEGORIES):
        name = launcher.get(kernel.get("args", {}).get("External id"))
        if name is None:
            continue  # launched outside the phase
        by_op[name][1] += kernel["dur"]
        by_kernel[kernel["name"]][0] += 1
        by_kernel[kernel["name"]][1] += kernel["dur"]
    return PhaseProfile(
        phase=phase,
        step=step,
        trace=str(trace),
        phase_us=round(sum(e - s for s, e in ranges), 1),
        device_us=round(sum(v[1] for v in by_kernel.values()), 1),
        ops=_rows(by_op, top),
        kernels=_rows(by_kernel, top),
    )
