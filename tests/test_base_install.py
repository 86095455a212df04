"""``pip install hsstore`` without extras is the store library: it opens and reads a store, and the
console script runs the store's verbs and names the extra a job needs (pyproject.toml).

The fast tests simulate the base install in a subprocess that cannot import the extras' modules;
the slow one installs the project into a fresh venv from the package registry (pip's own index
configuration; its cache makes a rerun fast) and reads a committed store there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from hsstore import MissingDependencyError
from hsstore.extras import EXTRA_OF_MODULE, import_optional
from tests.support.paths import REPO_ROOT

GOLDEN = REPO_ROOT / "tests" / "data" / "golden" / "zstd"

# What the base install lacks, made unimportable in a subprocess (a module that is not installed
# raises the same ModuleNotFoundError).
BLOCK_EXTRAS = f"""
import sys
BLOCKED = {sorted(EXTRA_OF_MODULE)!r}
class _ExtrasBlocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _ExtrasBlocker())
"""

# Opens a store, reads it the ways a notebook does, and checks no extra's module was loaded.
READ_STORE = f"""
import sys
import numpy as np
import hsstore
from hsstore import inspect as hi

store = hsstore.open_store(sys.argv[1])
sample = store.read_sample(0, as_numpy=True)
assert sample["input_ids"].dtype == np.int32 and len(sample["input_ids"]) > 0, sample
assert all(isinstance(v, (str, np.ndarray)) for v in sample.values())
shard = store.shards[0]
raw = store.read_token_range(shard.shard_id, 0, shard.num_tokens)
assert all(len(bits) == shard.num_tokens for bits in raw.values())
assert len(store.samples.to_pandas()) == store.num_samples
hi.summary(store)  # verifies the files too
try:
    store.read_sample(0)
except hsstore.MissingDependencyError as err:
    assert "pip install 'hsstore[train]'" in str(err), err
else:
    raise AssertionError("read_sample returned torch tensors without torch")
loaded = sorted({{name.partition(".")[0] for name in sys.modules}} & set({sorted(EXTRA_OF_MODULE)!r}))
assert not loaded, loaded
print("read", store.num_samples, "samples")
"""

# Runs the console script's main() on each argv of a JSON list, in one process (each start costs ~2 s):
# prints [[exit status, stdout, stderr], ...].
RUN_CLI = """
import contextlib, io, json
from pipelines.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""

def _run(code: str, *args: str, python: str = sys.executable, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture
def golden_store(tmp_path: Path) -> str:
    url = tmp_path / "store"
    shutil.copytree(GOLDEN, url, ignore=shutil.ignore_patterns("expected.npz"))
    return str(url)


def test_the_store_reads_without_any_extra(golden_store: str) -> None:
    out = _run(BLOCK_EXTRAS + READ_STORE, golden_store, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("read ")


def test_the_console_script_names_the_extra_a_job_needs(golden_store: str) -> None:
    jobs = [
        (["train", "recipes/reference/train-eagle3.yaml"], "train"),
        (["extract", "recipes/reference/extract.yaml"], "extract"),
        (["evaluate", "recipes/reference/evaluate.yaml"], "train"),
        (["sweep", "recipes/reference/sweep.yaml"], "all"),
        (["inspect", golden_store, "--plots", str(Path(golden_store).parent / "plots")], "all"),
    ]
    argvs = [["--help"], ["info", golden_store], *(argv for argv, _ in jobs)]
    out = _run(BLOCK_EXTRAS + RUN_CLI, json.dumps(argvs), cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    (help_status, _, _), (info_status, info, _), *job_results = json.loads(out.stdout)
    assert help_status == 0
    assert info_status == 0 and "aux layers" in info
    for (argv, extra), (status, _, stderr) in zip(jobs, job_results, strict=True):
        assert status == 1, (argv, stderr)
        assert f"pip install 'hsstore[{extra}]'" in stderr, (argv, stderr)
        assert "Traceback" not in stderr, stderr

def test_import_optional_names_the_extra() -> None:
    with pytest.raises(MissingDependencyError, match=re.escape("pip install 'hsstore[all]'")):
        import_optional("hsstore_no_such_module", "this test")
    with pytest.raises(ImportError, match="needs obstore"):  # MissingDependencyError is an ImportError
        raise MissingDependencyError("x needs obstore")
    assert import_optional("json", "this test").dumps([]) == "[]"


def _requirement_names(extra: str, extras: dict[str, list[str]]) -> set[str]:
    """Distribution names an extra installs, self-references (``hsstore[a,b]``) expanded."""
    names: set[str] = set()
    for requirement in extras[extra]:
        name = re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()
        if name == "hsstore":
            for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):  # type: ignore[union-attr]
                names |= _requirement_names(inner.strip(), extras)
        else:
            names.add(name)
    return names


def test_the_extras_table_matches_pyproject() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    base = {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in project["dependencies"]}
    provided_by = {"botocore": "s3fs"}  # comes with s3fs (aiobotocore)
    for module, extra in EXTRA_OF_MODULE.items():
        assert provided_by.get(module, module) in _requirement_names(extra, extras), (module, extra)
        assert module not in base, module
    assert {"extract", "train", "s3", "all", "test", "dev", "peers"} <= set(extras)
    everything = _requirement_names("all", extras)
    assert all(provided_by.get(m, m) in everything for m in EXTRA_OF_MODULE)


@pytest.mark.slow
def test_a_fresh_venv_with_the_base_install_reads_a_store(tmp_path: Path, golden_store: str) -> None:
    """The package built from this checkout, installed without extras into a new venv (no torch,
    Ray or transformers there), opens and reads a committed store; its console script runs
    ``info`` and names the extra for ``train``."""
    source = tmp_path / "src"  # only what the wheel is built from: the checkout's other files stay out
    for name in ("hsstore", "pipelines"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    venv = tmp_path / "venv"
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # The outer pip installs into the venv (--python): no ensurepip. --no-compile: the test runs each
    # module once. pip's cache and index configuration are the user's (CI: the package registry).
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-compile",
         "--disable-pip-version-check", str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, f"pip install of the base package failed (needs the package index):\n{install.stderr}"
    installed = time.perf_counter() - started
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for module in ("torch", "ray", "transformers"):
        probe = _run(f"import importlib.util; assert importlib.util.find_spec({module!r}) is None", python=python, env=env, cwd=tmp_path)
        assert probe.returncode == 0, f"{module} is importable in the base venv"
    out = _run(READ_STORE, golden_store, python=python, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    script = str(venv / "bin" / "hsstore")
    info = subprocess.run([script, "info", golden_store], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert info.returncode == 0 and "aux layers" in info.stdout, info.stderr
    recipe = str(REPO_ROOT / "recipes" / "reference" / "train-eagle3.yaml")
    train = subprocess.run([script, "train", recipe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert train.returncode == 1 and "pip install 'hsstore[train]'" in train.stderr, train.stderr
    print(f"base install {installed:.1f}s, total {time.perf_counter() - started:.1f}s")
