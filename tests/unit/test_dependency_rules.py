"""The dependency rules of docs/architecture.md, checked on the source (every import, nested ones too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RLRUN = Path(__file__).resolve().parents[2] / "rlrun"


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offenders(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> dict[str, list[str]]:
    found = {}
    for path in sorted((RLRUN / package).rglob("*.py")):
        rel = str(path.relative_to(RLRUN))
        bad = sorted(n for n in imports(path) if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad and rel not in allowed:
            found[rel] = bad
    return found


def test_algo_is_pure_tensor_math():
    assert offenders("algo", ("torch.distributed", "megatron", "rlrun.megatron", "rlrun.engine")) == {}


def test_engine_never_imports_megatron_and_only_the_sglang_backend_imports_sglang():
    assert offenders("engine", ("megatron", "rlrun.megatron")) == {}
    assert offenders(".", ("sglang",), allowed=("engine/backends/sglang.py",)) == {}


def test_components_never_import_the_loop_or_the_cli():
    loops = ("rlrun.trainer.loop", "rlrun.cli")
    assert offenders(".", loops, allowed=("cli.py", "__main__.py", "loop.py")) == {}


def test_the_config_and_its_tables_load_without_torch():
    code = (
        "import sys, rlrun.config.schema, rlrun.algo.specs, rlrun.engine.registry; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=RLRUN.parent)
    assert result.returncode == 0, result.stderr


def test_the_checks_find_what_they_look_for():
    assert "torch.distributed" in imports(RLRUN / "trainer" / "actor.py")
    assert offenders("megatron", ("torch.distributed",))  # megatron/ may: the check is not vacuous
