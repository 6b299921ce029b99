"""The dependency rules of docs/architecture.md, checked on the source (every import, nested ones too).

The root package (``rlrun/__init__.py``, ``cli.py``, ``__main__.py``: the entry points) is the top of the graph: it
may import any module (``rlrun.train`` imports the trainer on first use), and no module below it imports it, which
``test_nothing_imports_the_root_package`` checks. Its edges are counted like any others, so a module that imported
the root would close a circle through the trainer and fail the circle tests too.
"""

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
    assert offenders(".", loops, allowed=("cli.py", "__main__.py", "trainer/loop.py", "trainer/api.py")) == {}


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


# The import graph: every module's rlrun imports (module-level, nested and TYPE_CHECKING ones alike), as edges
# between modules and between packages. A package is rlrun.<first level>, and rlrun.engine.embedded and
# rlrun.engine.backends apart from rlrun.engine (an engine is a package of its own).

SPLIT_PACKAGES = ("rlrun.engine.embedded", "rlrun.engine.backends")
ROOT_MODULES = ("rlrun", "rlrun.cli", "rlrun.__main__")
"""The root package: the entry points, one package of the graph."""


def module_name(path: Path, root: Path = RLRUN) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(root: Path = RLRUN) -> dict[str, set[str]]:
    """Module -> the rlrun modules it imports. ``from pkg import name`` is an edge to ``pkg.name`` when that is
    a module, else to ``pkg``; relative imports are resolved."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".")[: len(name.split(".")) - (path.name != "__init__.py")]
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in paths]
                found.update(subs or [base])
        graph[name] = {_owner(target, paths) for target in found} - {None, name}
    return graph


def _owner(target: str, modules: dict) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def package_of(module: str) -> str:
    if module in ROOT_MODULES:
        return "rlrun"
    for split in SPLIT_PACKAGES:
        if module == split or module.startswith(split + "."):
            return split
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module)
        )
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted: every import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_finds_circles_and_only_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    graph = {"rlrun.engine.x": {"rlrun.engine.embedded.y"}, "rlrun.engine.embedded.y": {"rlrun.engine.z"}}
    assert cycles(package_graph(graph)) == [["rlrun.engine", "rlrun.engine.embedded"]]


def test_the_graph_sees_nested_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "rlrun" / "p"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlrun.p.b import X\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("def g():\n    import rlrun.p.a\n")
    graph = module_graph(tmp_path / "rlrun")
    assert graph["rlrun.p.a"] == {"rlrun.p.b"} and graph["rlrun.p.b"] == {"rlrun.p.c"}
    assert cycles(graph) == [["rlrun.p.a", "rlrun.p.b", "rlrun.p.c"]]


def test_the_config_is_a_leaf():
    graph = module_graph()
    outside = {m: sorted(t for t in ts if not t.startswith("rlrun.config")) for m, ts in graph.items()}
    assert {m: ts for m, ts in outside.items() if m.startswith("rlrun.config") and ts} == {}


def test_kernels_import_only_kernels():
    graph = module_graph()
    found = {m: sorted(t for t in ts if not t.startswith("rlrun.kernels")) for m, ts in graph.items()}
    assert {m: ts for m, ts in found.items() if m.startswith("rlrun.kernels") and ts} == {}


def test_nothing_imports_the_root_package():
    graph = module_graph()
    root = set(ROOT_MODULES)
    assert {m: sorted(ts & root) for m, ts in graph.items() if m not in root and ts & root} == {}
    assert "rlrun.trainer.api" in graph["rlrun"]  # rlrun.train's lazy import is an edge the graph sees


def test_no_import_circle_between_packages():
    assert cycles(package_graph(module_graph())) == []


def test_no_import_circle_between_modules():
    assert cycles(module_graph()) == []
