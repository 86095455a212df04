"""The notebooks run top to bottom in a real kernel (nbclient) and write their plots; the committed
notebooks are exactly what notebooks/build_notebooks.py generates, with outputs cleared."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support.paths import REPO_ROOT

NOTEBOOKS = REPO_ROOT / "notebooks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def execute(name: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return notebook


def png_outputs(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in out.get("data", {}) for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)


def assert_pngs(paths: list[Path]) -> None:
    for path in paths:
        assert path.exists(), f"{path} was not written"
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5_000, path


def test_committed_notebooks_are_generated_and_cleared():
    builder = load_builder()
    for name in builder.NOTEBOOKS:
        text = (NOTEBOOKS / name).read_text()
        assert text == builder.render(name), f"{name} differs from build_notebooks.py: run python notebooks/build_notebooks.py"
        notebook = nbformat.reads(text, as_version=4)
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in notebook.cells if c.cell_type == "code")


@pytest.mark.slow
def test_inspect_notebook_extracts_a_store_and_writes_its_plots(tmp_path, monkeypatch):
    monkeypatch.delenv("STORE", raising=False)
    monkeypatch.delenv("FP8_STORE", raising=False)
    monkeypatch.setenv("WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("PLOTS_DIR", str(tmp_path / "plots"))
    notebook = execute("01_inspect_store.ipynb")
    assert (tmp_path / "work" / "reference-store-bf16" / "manifest.json").exists()  # made by the extraction
    plots = tmp_path / "plots"
    assert_pngs([plots / f"{name}.png" for name in ("length_histogram", "token_frequency", "layer_stats", "token_view", "bf16_vs_fp8")])
    assert_pngs([plots / "inspect" / f"{name}.png" for name in ("length_histogram", "token_frequency", "layer_stats", "token_view")])
    assert png_outputs(notebook) == 5
    text = "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)
    assert "health     OK (checksums verified)" in text and "hidden states per layer" in text


@pytest.mark.slow
def test_sweep_notebook_runs_a_tiny_sweep_then_reads_a_given_one(tmp_path, monkeypatch, reference_store):
    monkeypatch.setenv("STORE", reference_store)
    monkeypatch.delenv("SWEEP_DIR", raising=False)
    monkeypatch.setenv("WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("PLOTS_DIR", str(tmp_path / "plots"))
    notebook = execute("02_sweep_results.ipynb")
    sweep = tmp_path / "work" / "sweep"
    assert_pngs([sweep / "plots" / "recall_0_vs_ttt_length.png", sweep / "plots" / "recall_0_vs_candidate_head.rank.png",
                 tmp_path / "plots" / "per_depth.png"])
    assert png_outputs(notebook) == 3
    assert (sweep / "results.parquet").exists() and not (tmp_path / "work" / "reference-store-bf16").exists()

    # Reading a finished sweep: nothing trains, the same plots are shown.
    monkeypatch.setenv("SWEEP_DIR", str(sweep))
    monkeypatch.setenv("PLOTS_DIR", str(tmp_path / "plots-read"))
    before = {p: p.stat().st_mtime_ns for p in sweep.glob("points/*/done.json")}
    notebook = execute("02_sweep_results.ipynb")
    assert png_outputs(notebook) == 3 and (tmp_path / "plots-read" / "per_depth.png").exists()
    assert {p: p.stat().st_mtime_ns for p in sweep.glob("points/*/done.json")} == before
    assert "4 of 4 points done" in "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs)
