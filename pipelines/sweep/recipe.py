"""The sweep recipe, and its expansion into points with deterministic names.

A sweep trains one draft per point of a grid over a base training recipe, all from the same store::

    base: recipes/reference/train-eagle4.yaml     # a TrainRecipe file, or an inline mapping
    overrides: {max_steps: 200}                   # applied to every point (dotted keys or nested)
    grid:                                         # dotted TrainRecipe keys -> values
      ttt_length: [3, 5, 7]
      candidate_head.rank: [32, 128]
    stages: [draft, candidate_head]               # EAGLE-4: fit a candidate head on each draft
    output_dir: runs/sweep

Keys under ``candidate_head.`` only change stage 2, so points that differ only there share one
stage-1 draft (trained once, under ``drafts/``). Every recipe a point will run is built and validated
here, so a bad key or a contradiction (``draft.sliding_window < ttt_length``) fails before anything
trains.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from hsstore.errors import RecipeError
from pipelines.recipe import RecipeModel, apply_overrides, build_recipe, read_yaml
from pipelines.train.config import TrainRecipe

STAGE2_PREFIX = "candidate_head."
# Keys a sweep sets itself for every point; sweeping them would make points overwrite each other.
RESERVED_KEYS = ("output_dir", "stage", "candidate_head.draft_checkpoint")


class EvaluateSettings(RecipeModel):
    """How each point's draft is evaluated (``pipelines.evaluate.run_evaluation``).

    The sweep sets the evaluate recipe's ``draft`` (the point's final checkpoint: stage 2's when the
    sweep has one, else stage 1's) and ``output_dir`` (the point's ``eval/``); everything else comes
    from ``recipe`` and ``overrides``.
    """

    recipe: str | dict[str, Any] = Field(description="an EvaluateRecipe file or inline mapping")
    overrides: dict[str, Any] = Field(default_factory=dict, description="dotted keys applied to it")


class RaySettings(RecipeModel):
    """Ray executor: one task per stage-1 draft and per point (a point waits for its draft)."""

    address: str | None = Field(default=None, description="cluster address; null starts Ray locally")
    num_cpus_per_point: float = Field(default=1.0, gt=0, description="CPUs reserved by each training task")
    num_gpus_per_point: float | None = Field(
        default=None, ge=0, description="GPUs per task; default 1 when the cluster has GPUs, else 0"
    )
    max_retries: int = Field(default=1, ge=0, description="Ray retries of a task whose worker died")


class SweepRecipe(RecipeModel):
    """``hsstore sweep RECIPE``: many drafts from one store."""

    base: str | dict[str, Any] = Field(
        description="the training recipe every point starts from: a file (relative to the working "
        "directory, else to this recipe's directory) or an inline mapping"
    )
    head_base: str | dict[str, Any] | None = Field(
        default=None,
        description="the stage-2 (candidate head) recipe, e.g. with its own optimizer and schedule; "
        "default: base. The sweep sets its stage, output_dir and draft_checkpoint",
    )
    overrides: dict[str, Any] = Field(default_factory=dict, description="applied to every point first")
    grid: dict[str, list[Any]] = Field(
        default_factory=dict, description="dotted TrainRecipe key -> values; the sweep is their product"
    )
    stages: list[Literal["draft", "candidate_head"]] = Field(
        default_factory=lambda: ["draft"],
        description="[draft], or [draft, candidate_head] for EAGLE-4: stage 2 on each stage-1 draft",
    )
    evaluate: EvaluateSettings | None = Field(default=None, description="evaluate each point's draft")
    metric: str | None = Field(
        default=None,
        description="results column plotted against each swept key; default: acceptance_length with "
        "evaluate, else recall_0 with a candidate head, else acc_0",
    )
    output_dir: str = Field(description="points/<name>/, drafts/<name>/, results.parquet/.csv, plots/")
    executor: Literal["sequential", "ray"] = Field(default="sequential")
    ray: RaySettings = Field(default_factory=RaySettings)
    stop_on_error: bool = Field(
        default=False, description="stop at the first failed point (default: record it and go on)"
    )

    @field_validator("overrides", mode="before")
    @classmethod
    def _flatten_overrides(cls, value: Any) -> Any:
        return flatten(value) if isinstance(value, dict) else value

    @field_validator("grid")
    @classmethod
    def _check_grid(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid.{key}: give at least one value")
            if key in RESERVED_KEYS:
                raise ValueError(f"grid.{key}: set by the sweep for every point, cannot be swept")
            if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
                raise ValueError(f"grid.{key}: repeated values {values}")
        return grid

    @model_validator(mode="after")
    def _check_stages(self) -> SweepRecipe:
        if self.stages[0] != "draft" or len(set(self.stages)) != len(self.stages):
            raise ValueError(f"stages must be [draft] or [draft, candidate_head], got {self.stages}")
        stage2_keys = [k for k in [*self.grid, *self.overrides] if k.startswith(STAGE2_PREFIX)]
        if stage2_keys and "candidate_head" not in self.stages:
            raise ValueError(
                f"{stage2_keys[0]} only changes stage 2: add candidate_head to stages "
                "(stages: [draft, candidate_head])"
            )
        return self


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: nested and dotted spellings mean the same override."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def parse_grid_args(items: list[str]) -> dict[str, list[Any]]:
    """``["ttt_length=3,5", "candidate_head.rank=16,64"]`` -> grid. Values are YAML (``3``, ``true``);
    a value holding commas needs the recipe's ``grid:`` block instead."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise RecipeError(f"--grid {item!r} is not KEY=V1,V2,... (e.g. --grid ttt_length=3,5,7)")
        try:
            grid[key] = [yaml.safe_load(part) for part in raw.split(",")]
        except yaml.YAMLError as err:
            raise RecipeError(f"--grid {key}: {raw!r} is not a comma-separated list of YAML values: {err}") from err
    return grid


def load_sweep_recipe(path: str | Path, overrides: list[str] | None = None, grid: dict[str, list[Any]] | None = None) -> SweepRecipe:
    """Read a sweep recipe; ``--set`` overrides apply to the sweep recipe, ``--grid`` keys replace or
    extend its ``grid:``. A relative ``base`` file is resolved here and stored as given."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    if grid:
        data["grid"] = {**(data.get("grid") or {}), **grid}
    recipe = build_recipe(SweepRecipe, data, source=str(path))
    if isinstance(recipe.base, str):
        recipe.base = str(resolve_base_path(recipe.base, Path(path).parent))
    if isinstance(recipe.head_base, str):
        recipe.head_base = str(resolve_base_path(recipe.head_base, Path(path).parent))
    return recipe


def resolve_base_path(base: str, recipe_dir: Path) -> Path:
    for candidate in (Path(base), recipe_dir / base):
        if candidate.is_file():
            return candidate
    raise RecipeError(f"training recipe {base!r} not found (looked in the working directory and {recipe_dir})")


def point_name(overrides: dict[str, Any]) -> str:
    """A directory name from the overrides alone: readable ``key=value`` parts (the last dotted part
    of each key) plus a hash of the exact overrides, so that names never collide."""
    canonical = json.dumps(overrides, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    parts = [f"{key.rsplit('.', 1)[-1]}={_compact(value)}" for key, value in overrides.items()]
    readable = re.sub(r"[^A-Za-z0-9._=+-]", "_", "__".join(parts))[:100]
    return f"{readable}-{digest}" if readable else f"base-{digest}"


def _compact(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


@dataclass
class SweepPoint:
    """One grid point: what it overrides, where it lives, and the recipes it runs."""

    name: str
    overrides: dict[str, Any]  # grid keys only, in grid order
    draft_name: str  # stage-1 draft directory name (shared by points that differ only in stage 2)
    draft_recipe: TrainRecipe
    head_recipe: TrainRecipe | None = None
    evaluate_recipe: dict[str, Any] | None = None  # raw mapping; validated by the evaluate job
    recipes_json: dict[str, Any] = field(default_factory=dict)  # what done.json pins


def expand(recipe: SweepRecipe) -> list[SweepPoint]:
    """Every point of the grid, with its recipes built and validated."""
    out = Path(recipe.output_dir)
    base, source = _base(recipe.base, "base")
    head_base, head_source = _base(recipe.head_base, "head_base") if recipe.head_base is not None else (base, source)
    keys = list(recipe.grid)
    points = []
    for values in itertools.product(*(recipe.grid[k] for k in keys)):
        grid_values = dict(zip(keys, values, strict=True))
        stage1 = {k: v for k, v in grid_values.items() if not k.startswith(STAGE2_PREFIX)}
        common = {k: v for k, v in recipe.overrides.items() if not k.startswith(STAGE2_PREFIX)}
        name, draft_name = point_name(grid_values), point_name(stage1)
        draft_recipe = _train_recipe(base, {**common, **stage1, "stage": "draft",
                                            "output_dir": str(out / "drafts" / draft_name)}, source, name)
        head_recipe = None
        if "candidate_head" in recipe.stages:
            head_recipe = _train_recipe(head_base, {**recipe.overrides, **grid_values, "stage": "candidate_head",
                                               "output_dir": str(out / "points" / name / "head"),
                                               "candidate_head.draft_checkpoint": str(out / "drafts" / draft_name / "checkpoints" / "final")},
                                        head_source, name)
        evaluate = None
        if recipe.evaluate is not None:
            final = Path((head_recipe or draft_recipe).output_dir) / "checkpoints" / "final"
            evaluate = _evaluate_mapping(recipe.evaluate, final, out / "points" / name / "eval")
        point = SweepPoint(name, grid_values, draft_name, draft_recipe, head_recipe, evaluate)
        point.recipes_json = {
            "draft": draft_recipe.model_dump(mode="json"),
            "head": head_recipe.model_dump(mode="json") if head_recipe else None,
            "evaluate": evaluate,
        }
        points.append(point)
    return points


def _base(base: str | dict[str, Any], key: str) -> tuple[dict[str, Any], str]:
    return (read_yaml(base), base) if isinstance(base, str) else (base, f"<inline {key}>")


def _train_recipe(base: dict[str, Any], overrides: dict[str, Any], source: str, point: str) -> TrainRecipe:
    sets = [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    return build_recipe(TrainRecipe, copy.deepcopy(base), sets, source=f"{source} for sweep point {point}")


def _evaluate_mapping(settings: EvaluateSettings, draft: Path, output_dir: Path) -> dict[str, Any]:
    data = read_yaml(settings.recipe) if isinstance(settings.recipe, str) else copy.deepcopy(settings.recipe)
    sets = [f"{k}={json.dumps(v)}" for k, v in {**flatten(settings.overrides), "draft": str(draft), "output_dir": str(output_dir)}.items()]
    data = apply_overrides(data, sets)
    from pipelines.evaluate import EvaluateRecipe  # light: the recipe model only

    build_recipe(EvaluateRecipe, copy.deepcopy(data), source="the sweep's evaluate recipe")  # fail before training
    return data


def default_metric(recipe: SweepRecipe) -> str:
    if recipe.metric:
        return recipe.metric
    if recipe.evaluate is not None:
        return "acceptance_length"
    return "recall_0" if "candidate_head" in recipe.stages else "acc_0"
