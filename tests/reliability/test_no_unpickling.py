"""Nothing is unpickled from a file a user did not create, and no remote code runs by default.

A static check over the project's own code (hsstore/, pipelines/, benchmarks/), by syntax tree, so
that a new call site cannot slip in: ``torch.load`` only with ``weights_only=True``; no pickle,
cloudpickle, dill, joblib, ``pandas.read_pickle`` or ``numpy.load(allow_pickle=True)``; YAML only
through ``yaml.safe_load``/``safe_dump``; ``trust_remote_code`` defaults to False everywhere and is
never switched on by a literal ``True``. Model weights travel as safetensors, everything else JSON.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.reliability

PACKAGES = ("hsstore", "pipelines", "benchmarks")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
UNSAFE_LOADS = {"load", "loads", "Unpickler", "open", "load_compatible"}


def sources() -> list[Path]:
    files = [p for package in PACKAGES for p in sorted((REPO_ROOT / package).rglob("*.py"))]
    assert len(files) > 30, files  # the check must actually see the code
    return files


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(path: Path, root: Path = REPO_ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = path.relative_to(root)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            line = f"{where}:{node.lineno}"
            if name.endswith("torch.load") and not is_true(keyword(node, "weights_only")):
                out.append(f"{line}: torch.load without weights_only=True")
            head, _, tail = name.rpartition(".")
            if head.split(".")[-1] in UNSAFE_MODULES and tail in UNSAFE_LOADS:
                out.append(f"{line}: {name} unpickles")
            if name.endswith(("read_pickle", "np.load", "numpy.load")) and (
                name.endswith("read_pickle") or is_true(keyword(node, "allow_pickle"))
            ):
                out.append(f"{line}: {name} may unpickle")
            if name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"):
                out.append(f"{line}: {name} (use yaml.safe_load)")
            if is_true(keyword(node, "trust_remote_code")):
                out.append(f"{line}: {name}(trust_remote_code=True)")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in names:
                if module.split(".")[0] in UNSAFE_MODULES:
                    out.append(f"{where}:{node.lineno}: imports {module}")
        elif isinstance(node, ast.arguments):
            # def f(..., trust_remote_code=<default>): the default must be False.
            positional = node.posonlyargs + node.args
            defaults = [None] * (len(positional) - len(node.defaults)) + list(node.defaults)
            pairs = list(zip(positional, defaults, strict=True)) + list(zip(node.kwonlyargs, node.kw_defaults, strict=True))
            for arg, default in pairs:
                if arg.arg == "trust_remote_code" and not (isinstance(default, ast.Constant) and default.value is False):
                    out.append(f"{where}:{arg.lineno}: parameter trust_remote_code must default to False")
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):
            # Dataclass and pydantic fields: trust_remote_code: bool = False / Field(False, ...).
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "trust_remote_code" for t in targets) and node.value is not None:
                value = node.value
                if isinstance(value, ast.Call):
                    default = value.args[0] if value.args else keyword(value, "default")
                else:
                    default = value
                if not (isinstance(default, ast.Constant) and default.value is False):
                    out.append(f"{where}:{node.lineno}: trust_remote_code must default to False")
    return out


def test_no_unpickling_no_unsafe_yaml_and_no_remote_code_by_default():
    problems = [finding for path in sources() for finding in findings(path)]
    assert problems == []


def test_the_check_catches_each_unsafe_pattern(tmp_path):
    """The checker itself, on code that does each forbidden thing (so a green run means something)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\n"
        "import torch, yaml, numpy as np\n"
        "from dataclasses import dataclass\n"
        "state = torch.load('x.pt')\n"
        "state = torch.load('x.pt', weights_only=False)\n"
        "obj = pickle.loads(b'')\n"
        "cfg = yaml.load(open('r.yaml'), Loader=yaml.Loader)\n"
        "arr = np.load('a.npy', allow_pickle=True)\n"
        "def load(path, trust_remote_code=True): ...\n"
        "@dataclass\n"
        "class Spec:\n"
        "    trust_remote_code: bool = True\n"
        "model = AutoModel.from_pretrained('m', trust_remote_code=True)\n"
    )
    found = findings(bad, root=tmp_path)
    expected = [
        "bad.py:1: imports pickle",
        "bad.py:4: torch.load without weights_only=True",
        "bad.py:5: torch.load without weights_only=True",
        "bad.py:6: pickle.loads unpickles",
        "bad.py:7: yaml.load (use yaml.safe_load)",
        "bad.py:8: np.load may unpickle",
        "bad.py:9: parameter trust_remote_code must default to False",
        "bad.py:12: trust_remote_code must default to False",
        "bad.py:13: AutoModel.from_pretrained(trust_remote_code=True)",
    ]
    assert sorted(found) == sorted(expected)


def test_yaml_recipes_cannot_construct_python_objects(tmp_path):
    from hsstore.errors import RecipeError
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(f"target: !!python/object/apply:pathlib.Path.touch [!!python/object/apply:pathlib.Path ['{marker}']]\n")
    with pytest.raises(RecipeError, match=r"evil.yaml is not valid YAML"):
        load_recipe(ExtractRecipe, path)
    assert not marker.exists()
