"""Whether to turn ``chunked_attention.TRANSPOSED_DECODE`` on, decided from benchmarks/chunked_decode_launch.py's JSON.

Why (issue 29): the transposed decode is only worth having if it is exact and faster, and a device session has no time
to read a JSON and edit code between its calls (the machine goes back after 30 s idle). So the rule is written here,
before the numbers exist, and the session applies it on the device: with ``--flip-script`` the script writes the two
``sed`` lines that set ``TRANSPOSED_DECODE = True`` and the chosen ``DECODE_STAGES`` in the device's copy of the tree,
which the session's later calls run before their tests and benchmarks (scripts/gpu/sglang_session.md).

The rule, for each transposed setting at the module's warps (the forward shares them): every decode row bitwise its
forward's at every head layout measured, faster than today's decode at every batch and key count measured, and the
forward (whose row sums become a multiply too) at most :data:`FORWARD_SLOWDOWN` slower. Of the settings that pass, the
one with the least total decode time.

    python3 benchmarks/decode_verdict.py benchmarks/results/chunked_decode_launch_transposed_h200.json \
        [--flip-script /tmp/flip.sh]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORWARD_SLOWDOWN = 1.05
"""The most the trainer's forward may slow (time with the row sums by a multiply / by ``tl.sum``)."""


def verdict(record: dict) -> dict:
    """``flip``, the ``stages`` to run at, ``why``, and each candidate's decode time relative to today's."""
    module = record["module"]
    warps = module["WARPS"]
    today = (warps, module["DECODE_STAGES"], False)

    def key(entry: dict) -> tuple[int, int, bool]:
        return entry["warps"], entry["stages"], entry["transposed"]

    candidates = sorted({key(e) for e in record["speed"] if e["transposed"] and e["warps"] == warps})
    base_us = {(e["batch"], e["length"]): e["us"] for e in record["speed"] if key(e) == today}
    if not base_us or not candidates:
        return {"flip": False, "stages": None, "why": "no measurement of today's decode or of a transposed one"}
    if any(e["elements_differing"] for e in record["exactness"] if key(e) == today):
        return {"flip": False, "stages": None, "why": "today's decode is not bitwise its forward: fix that first"}
    slowdowns = [e["sum_by_multiply_us"] / e["sum_us"] for e in record["forward"]]
    ratios: dict[str, dict[str, float]] = {}
    passing: list[tuple[float, int]] = []
    reasons = []
    for setting in candidates:
        label = f"stages_{setting[1]}"
        differing = sum(e["elements_differing"] for e in record["exactness"] if key(e) == setting)
        times = {(e["batch"], e["length"]): e["us"] for e in record["speed"] if key(e) == setting}
        ratios[label] = {f"b{b}_n{n}": round(us / base_us[b, n], 3) for (b, n), us in sorted(times.items())}
        if differing:
            reasons.append(f"{label}: {differing} decode elements differ from the forward's")
        elif set(times) != set(base_us) or any(times[shape] >= base_us[shape] for shape in base_us):
            reasons.append(f"{label}: not faster at every batch and key count ({ratios[label]})")
        else:
            passing.append((sum(times.values()), setting[1]))
    if max(slowdowns, default=1.0) > FORWARD_SLOWDOWN:
        reasons.append(f"the forward slows {max(slowdowns):.3f}x with the row sums by a multiply")
        passing = []
    if not passing:
        return {"flip": False, "stages": None, "why": "; ".join(reasons), "decode_time_ratio": ratios}
    stages = min(passing)[1]
    return {
        "flip": True,
        "stages": stages,
        "why": f"bitwise and faster at every shape at {stages} stages; forward x{max(slowdowns, default=1.0):.3f}",
        "decode_time_ratio": ratios,
    }


def flip_script(stages: int) -> str:
    """The ``sed`` lines that set the verdict in ``rlrun/chunked_attention.py`` (run from the repository root)."""
    return (
        "sed -i 's/^TRANSPOSED_DECODE = False$/TRANSPOSED_DECODE = True/' rlrun/chunked_attention.py\n"
        f"sed -i 's/^DECODE_STAGES = [0-9]*$/DECODE_STAGES = {stages}/' rlrun/chunked_attention.py\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("record", type=Path, help="chunked_decode_launch.py's JSON")
    parser.add_argument("--flip-script", type=Path, help="written only if the verdict is to flip")
    args = parser.parse_args()
    result = verdict(json.loads(args.record.read_text()))
    print(json.dumps(result, indent=2))
    if result["flip"] and args.flip_script:
        args.flip_script.write_text(flip_script(result["stages"]))


if __name__ == "__main__":
    main()
