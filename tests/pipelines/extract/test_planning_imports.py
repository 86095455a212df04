"""Planning (``hsstore extract RECIPE --dry-run``, the streaming planner) loads no model code:
no torch, none of the modules that run the target.

transformers >= 5 imports torch as soon as ``AutoTokenizer`` is imported, whenever torch is installed
(``tokenization_auto`` -> ``configuration_utils`` -> ``modeling_rope_utils``: ``if
is_torch_available(): import torch``), so planning loads the reference target's tokenizer class
directly (pipelines/extract/tokenizer_loader.py). The first test plans in a fresh interpreter where
torch cannot be imported (``sys.modules["torch"] = None``: how an install without torch looks both
to ``import`` and to transformers' ``find_spec`` probe); any ``import torch`` on the planning path
fails that run. The second plans with torch installed and checks that nothing imported it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.pipelines.extract.conftest import MIXED_RECORDS, write_jsonl
from tests.pipelines.extract.helpers import make_recipe
from tests.support.paths import REFERENCE_TARGET, REPO_ROOT

# The extraction modules that run the target: none of them may load while planning.
MODEL_SIDE_MODULES = [
    "pipelines.extract.capture",
    "pipelines.extract.executors",
    "pipelines.extract.gpu_timing",
    "pipelines.extract.isolation",
    "pipelines.extract.placement",
    "pipelines.extract.profiling",
    "pipelines.extract.sink",
    "pipelines.extract.warm_up",
    "pipelines.extract.worker",
]
REPORT_MARKER = "--- import report ---"

DRY_RUN_SCRIPT = """
import json, sys
{prelude}
from pipelines.cli import main

assert main(["extract", sys.argv[1], "--dry-run", "--json"]) == 0
print({marker!r})
print(json.dumps({{
    "model_side_loaded": sorted(m for m in {model_side!r} if m in sys.modules),
    "torch_imported": sys.modules.get("torch") is not None,
    "torch_importers": globals().get("TORCH_IMPORTERS", []),
}}))
"""

# Records the file that imports torch at each import of it (the frame below the import machinery)
# and lets the import go on. transformers' availability probes (``importlib.util.find_spec``, which
# also asks the finders) import nothing and are not recorded.
RECORD_TORCH_IMPORTERS = """
import traceback

TORCH_IMPORTERS = []


class RecordTorchImporters:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            stack = traceback.extract_stack()[:-1]
            if not any(f.name == "find_spec" and "importlib" in f.filename for f in stack):
                files = [f.filename for f in stack if not f.filename.startswith("<frozen")]
                TORCH_IMPORTERS.append(files[-1])
        return None


sys.meta_path.insert(0, RecordTorchImporters())
"""


def dry_run_in_a_fresh_interpreter(recipe_path: Path, prelude: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``hsstore extract RECIPE --dry-run --json`` in a new process: its summary and what it imported."""
    script = DRY_RUN_SCRIPT.format(prelude=prelude, marker=REPORT_MARKER, model_side=MODEL_SIDE_MODULES)
    done = subprocess.run(
        [sys.executable, "-c", script, str(recipe_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary, report = done.stdout.split(REPORT_MARKER)
    return json.loads(summary), json.loads(report)


def small_recipe(tmp_path: Path) -> Path:
    """The reference target over a few records (a duplicate and a bad line among them), as a
    recipe file (JSON is YAML)."""
    data = write_jsonl(tmp_path / "data.jsonl", [*MIXED_RECORDS, b"{not json", MIXED_RECORDS[0]])
    recipe = make_recipe(REFERENCE_TARGET, [data], tmp_path / "store", planning={"num_workers": 1})
    path = tmp_path / "extract.yaml"
    path.write_text(json.dumps(recipe.model_dump(mode="json")))
    return path


def test_planning_runs_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    from pipelines.extract import run_extraction
    from pipelines.extract.recipe import ExtractRecipe
    from pipelines.recipe import load_recipe

    recipe_path = small_recipe(tmp_path)
    summary, report = dry_run_in_a_fresh_interpreter(recipe_path, prelude='sys.modules["torch"] = None')
    assert report == {"model_side_loaded": [], "torch_imported": False, "torch_importers": []}
    assert summary["num_records"] == len(MIXED_RECORDS) + 2
    assert summary["rejected"] == {"duplicate": 1, "not_json": 1}
    assert not (tmp_path / "store").exists()
    # The same plan as a dry run where torch is importable: the tokenizer does not depend on it.
    here = run_extraction(load_recipe(ExtractRecipe, recipe_path), dry_run=True)
    for field in ("num_records", "num_samples", "num_tokens", "num_loss_tokens", "num_units", "rejected", "num_padded_tokens"):
        assert summary[field] == getattr(here, field), field


def test_with_torch_installed_planning_does_not_import_it(tmp_path: Path) -> None:
    assert importlib.util.find_spec("torch") is not None, "this test needs torch installed"
    _, report = dry_run_in_a_fresh_interpreter(small_recipe(tmp_path), prelude=RECORD_TORCH_IMPORTERS)
    assert report["model_side_loaded"] == []
    assert report["torch_importers"] == [], report["torch_importers"]
    assert report["torch_imported"] is False


def test_the_driver_of_a_ray_run_imports_no_torch() -> None:
    """The executors name the worker without importing it (its module imports torch): Ray's actors
    import it in their own processes while the driver plans, so torch's import is off the start's
    critical path. The in-process executor imports it on its worker-building thread."""
    code = (
        "import sys\n"
        "import pipelines.extract.driver, pipelines.extract.executors, pipelines.extract.unit_runner\n"
        "from pipelines.extract.executors import RayExecutor, extraction_worker\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
