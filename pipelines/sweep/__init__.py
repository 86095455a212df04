"""Sweeps: many drafts from one store (``hsstore sweep``), resumable, in sequence or as Ray tasks.

Python use::

    from pipelines.sweep import load_sweep_recipe, run_sweep

    recipe = load_sweep_recipe("recipes/reference/sweep.yaml", grid={"ttt_length": [3, 7]})
    report = run_sweep(recipe)
    report.results          # pandas DataFrame, also results.parquet / results.csv

Importing this package is light (pydantic only); torch and Ray load when points run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipelines.sweep.recipe import (
    SweepRecipe,
    expand,
    load_sweep_recipe,
    parse_grid_args,
    point_name,
)

if TYPE_CHECKING:
    from pipelines.sweep.runner import SweepReport as SweepReport
    from pipelines.sweep.runner import run_sweep as run_sweep


def __getattr__(name: str) -> Any:
    if name in ("run_sweep", "SweepReport"):
        from pipelines.sweep import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SweepRecipe", "SweepReport", "expand", "load_sweep_recipe", "parse_grid_args", "point_name", "run_sweep"]
