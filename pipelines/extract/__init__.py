"""Batch extraction: run the target once over a dataset and fill the store (Ray or in-process).

Python use::

    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import load_recipe

    recipe = load_recipe(ExtractRecipe, "recipes/reference/extract.yaml", ["limit=20", "executor=local"])
    summary = run_extraction(recipe)
    print(summary.format())

Importing this package is light (pydantic only); torch, transformers and Ray load when a run starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelines.extract.recipe import ExtractRecipe
from pipelines.extract.summary import ExtractionSummary

if TYPE_CHECKING:
    from pipelines.extract.driver import CommitHook


def run_extraction(
    recipe: ExtractRecipe,
    *,
    progress: bool = False,
    on_commit: CommitHook | None = None,
    dry_run: bool = False,
) -> ExtractionSummary:
    """Run (or resume) the extraction ``recipe`` describes; see :mod:`pipelines.extract.driver`."""
    from pipelines.extract.driver import run_extraction as _run

    return _run(recipe, progress=progress, on_commit=on_commit, dry_run=dry_run)


__all__ = ["ExtractRecipe", "ExtractionSummary", "run_extraction"]
