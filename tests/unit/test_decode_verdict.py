"""benchmarks/decode_verdict.py: the rule that turns the transposed decode on in a device session, and the script that
applies it to the real ``rlrun/chunked_attention.py``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from decode_verdict import flip_script, verdict  # noqa: E402

SHAPES = ((64, 256), (64, 2048), (128, 256))
LAYOUTS = ((16, 8), (9, 3))


def record(times: dict[tuple[int, int, bool], float], differing=None, forward=(100.0, 102.0), faster_at=None) -> dict:
    """A chunked_decode_launch.py record: each setting's decode ``times[setting]`` us at every shape (or ``faster_at``
    overrides one shape), ``differing[setting]`` elements off the forward at one layout, the forward's two times."""
    differing = differing or {}
    return {
        "module": {"WARPS": 4, "DECODE_STAGES": 3, "TRANSPOSED_DECODE": False},
        "exactness": [
            {
                "heads": h,
                "kv_heads": kv,
                "warps": w,
                "stages": s,
                "transposed": t,
                "elements_differing": differing.get((w, s, t), 0) if (h, kv) == LAYOUTS[0] else 0,
            }
            for (w, s, t) in times
            for h, kv in LAYOUTS
        ],
        "speed": [
            {
                "batch": b,
                "length": n,
                "warps": w,
                "stages": s,
                "transposed": t,
                "us": (faster_at or {}).get((w, s, t, b, n), us),
            }
            for (w, s, t), us in times.items()
            for b, n in SHAPES
        ],
        "forward": [{"samples": 4, "length": 8192, "sum_us": forward[0], "sum_by_multiply_us": forward[1]}],
    }


TODAY = (4, 3, False)


def test_flips_to_the_fastest_exact_setting() -> None:
    result = verdict(record({TODAY: 30.0, (4, 2, True): 20.0, (4, 3, True): 18.0, (4, 4, True): 19.0}))
    assert result["flip"] and result["stages"] == 3
    assert result["decode_time_ratio"]["stages_3"]["b64_n256"] == pytest.approx(0.6)


def test_a_setting_off_the_forward_is_never_chosen() -> None:
    times = {TODAY: 30.0, (4, 2, True): 20.0, (4, 3, True): 18.0}
    result = verdict(record(times, differing={(4, 3, True): 1}))
    assert result["flip"] and result["stages"] == 2
    result = verdict(record(times, differing={(4, 3, True): 1, (4, 2, True): 5}))
    assert not result["flip"] and "differ" in result["why"]


def test_slower_at_one_shape_keeps_it_off() -> None:
    result = verdict(record({TODAY: 30.0, (4, 3, True): 18.0}, faster_at={(4, 3, True, 128, 256): 31.0}))
    assert not result["flip"] and "not faster" in result["why"]


def test_other_warps_are_not_candidates() -> None:
    """8 warps would change the forward too (one ``WARPS`` for both)."""
    result = verdict(record({TODAY: 30.0, (8, 3, True): 10.0, (4, 3, True): 29.0}))
    assert result["flip"] and result["stages"] == 3 and "stages_3" in result["decode_time_ratio"]
    assert set(result["decode_time_ratio"]) == {"stages_3"}


def test_a_slower_forward_keeps_it_off() -> None:
    result = verdict(record({TODAY: 30.0, (4, 3, True): 18.0}, forward=(100.0, 106.0)))
    assert not result["flip"] and "forward slows" in result["why"]


def test_today_off_its_forward_keeps_it_off() -> None:
    result = verdict(record({TODAY: 30.0, (4, 3, True): 18.0}, differing={TODAY: 2}))
    assert not result["flip"] and "today's decode" in result["why"]


def test_the_flip_script_sets_both_constants_in_the_real_module(tmp_path: Path) -> None:
    shutil.copytree(REPO / "rlrun", tmp_path / "rlrun", ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / "rlrun" / "chunked_attention.py"
    before = module.read_text()
    assert re.search(r"^TRANSPOSED_DECODE = False$", before, re.M), "the flip expects the decode off in the tree"
    (tmp_path / "flip.sh").write_text(flip_script(2))
    subprocess.run(["bash", "flip.sh"], cwd=tmp_path, check=True)
    after = module.read_text()
    assert re.search(r"^TRANSPOSED_DECODE = True$", after, re.M)
    assert re.search(r"^DECODE_STAGES = 2$", after, re.M)
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b]
    assert len(changed) == 2  # nothing else touched
