"""The package's shape: no import cycle inside hsstore/, and importing it stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "hsstore"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the hsstore modules it imports anywhere in its body (function-level and
    TYPE_CHECKING imports included: a lazy import in a circle is still a circle). ``from pkg import
    name`` points at ``pkg.name`` when that is a module, else at ``pkg``. Parent packages, which
    Python imports first anyway, are not edges."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_inside_hsstore() -> None:
    graph = import_graph()
    assert "hsstore.format.codecs" in graph["hsstore.store"]  # the graph sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_hsstore_stays_light() -> None:
    """No module of an install extra (torch, Ray, transformers, s3fs, matplotlib...: hsstore.extras)
    is imported by ``import hsstore``; the torch-facing modules import torch when called."""
    code = (
        "import sys, hsstore; from hsstore.extras import EXTRA_OF_MODULE; "
        "bad = set(EXTRA_OF_MODULE) & {name.partition('.')[0] for name in sys.modules}; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_module_of_hsstore_is_long() -> None:
    """One concept per module: ~400 lines at most (issue 14's bound, with a little slack)."""
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 420} == {}


def test_hsstore_never_imports_pipelines() -> None:
    """The layer rule (docs/architecture.md): pipelines build on hsstore, never the reverse."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] == "pipelines"]
    assert offenders == []
