"""The architecture's size and layering rules (issue 29), checked so that they stay true:

- no module of ``hsstore/`` or ``pipelines/`` over 400 lines, no function over 80;
- ``hsstore/`` never imports the pipelines.

(Only ``hsstore/storage/`` asking which backend a location is: tests/hsstore/test_storage_boundary.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO_ROOT

PACKAGES = ("hsstore", "pipelines")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (REPO_ROOT / package).rglob("*.py"))


def test_no_module_over_400_lines() -> None:
    long = {
        str(p.relative_to(REPO_ROOT)): n
        for p in modules(*PACKAGES)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_over_80_lines() -> None:
    long = {}
    for path in modules(*PACKAGES):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}"] = lines
    assert long == {}


def test_the_store_library_never_imports_the_pipelines() -> None:
    importers = []
    for path in modules("hsstore"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(name == "pipelines" or name.startswith("pipelines.") for name in names):
                importers.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert importers == []
