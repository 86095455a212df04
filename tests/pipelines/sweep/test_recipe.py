"""Sweep recipes: grid parsing, point expansion and names, validation before anything trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hsstore.errors import RecipeError
from pipelines.sweep import SweepRecipe, expand, load_sweep_recipe, parse_grid_args, point_name
from tests.pipelines.sweep.helpers import tiny_train_base
from tests.support.paths import REPO_ROOT as REPO


def sweep(tmp_path: Path, **fields) -> SweepRecipe:
    data = {"base": tiny_train_base("some/store"), "output_dir": str(tmp_path / "out"), **fields}
    return SweepRecipe.model_validate(data)


def test_grid_arguments_are_comma_separated_yaml_values():
    assert parse_grid_args(["ttt_length=3,5", "candidate_head.rank=16", "draft.sliding_window=null,8"]) == {
        "ttt_length": [3, 5], "candidate_head.rank": [16], "draft.sliding_window": [None, 8],
    }
    with pytest.raises(RecipeError, match=r"--grid 'ttt_length' is not KEY=V1,V2"):
        parse_grid_args(["ttt_length"])
    with pytest.raises(RecipeError, match=r"--grid 'ttt_length=' is not KEY=V1,V2"):
        parse_grid_args(["ttt_length="])


def test_points_are_the_product_and_stage2_keys_share_drafts(tmp_path):
    recipe = sweep(tmp_path, grid={"ttt_length": [2, 3], "candidate_head.rank": [8, 16, 32]}, stages=["draft", "candidate_head"])
    points = expand(recipe)
    assert len(points) == 6 and len({p.name for p in points}) == 6
    assert len({p.draft_name for p in points}) == 2  # one stage-1 draft per ttt_length
    first = points[0]
    assert first.overrides == {"ttt_length": 2, "candidate_head.rank": 8}
    assert first.draft_recipe.ttt_length == 2 and first.draft_recipe.stage == "draft"
    assert first.draft_recipe.output_dir == str(tmp_path / "out" / "drafts" / first.draft_name)
    head = first.head_recipe
    assert head is not None and head.stage == "candidate_head" and head.candidate_head.rank == 8 and head.ttt_length == 2
    assert head.candidate_head.draft_checkpoint == str(tmp_path / "out" / "drafts" / first.draft_name / "checkpoints" / "final")
    assert head.output_dir == str(tmp_path / "out" / "points" / first.name / "head")
    # Points do not leak overrides into each other (the base's nested mappings are copied).
    assert [p.head_recipe.candidate_head.rank for p in points] == [8, 16, 32, 8, 16, 32]
    # Stage 2 may start from its own recipe (its optimizer, schedule); swept keys reach both stages.
    head_base = {**tiny_train_base("some/store"), "optimizer": {"lr": 0.5}}
    with_head_base = sweep(tmp_path, grid={"ttt_length": [2, 3], "candidate_head.rank": [8]},
                           stages=["draft", "candidate_head"], head_base=head_base)
    point = expand(with_head_base)[1]
    assert point.head_recipe.optimizer.lr == 0.5 and point.draft_recipe.optimizer.lr != 0.5
    assert point.head_recipe.ttt_length == point.draft_recipe.ttt_length == 3


def test_point_names_are_deterministic_readable_and_distinct():
    name = point_name({"ttt_length": 3, "candidate_head.rank": 16})
    assert name.startswith("ttt_length=3__rank=16-") and name == point_name({"ttt_length": 3, "candidate_head.rank": 16})
    assert point_name({"a.rank": 16}) != point_name({"b.rank": 16})  # same readable part, another key
    assert point_name({"x": "a/b"}).startswith("x=a_b-")
    assert point_name({}).startswith("base-")


def test_overrides_nested_or_dotted_mean_the_same(tmp_path):
    nested = sweep(tmp_path, overrides={"loader": {"token_budget": 64}, "max_steps": 3})
    dotted = sweep(tmp_path, overrides={"loader.token_budget": 64, "max_steps": 3})
    assert nested.overrides == dotted.overrides == {"loader.token_budget": 64, "max_steps": 3}
    point = expand(nested)[0]
    assert point.draft_recipe.loader.token_budget == 64 and point.draft_recipe.max_steps == 3


def test_bad_sweeps_fail_before_training_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="candidate_head.rank only changes stage 2: add candidate_head to stages"):
        sweep(tmp_path, grid={"candidate_head.rank": [8]})
    with pytest.raises(ValueError, match="grid.output_dir: set by the sweep for every point"):
        sweep(tmp_path, grid={"output_dir": ["a", "b"]})
    with pytest.raises(ValueError, match=r"grid.ttt_length: repeated values \[2, 2\]"):
        sweep(tmp_path, grid={"ttt_length": [2, 2]})
    with pytest.raises(ValueError, match="grid.ttt_length: give at least one value"):
        sweep(tmp_path, grid={"ttt_length": []})
    with pytest.raises(RecipeError, match=r"(?s)for sweep point ttt_lenght=2-\w+:.*ttt_lenght: unknown key"):
        expand(sweep(tmp_path, grid={"ttt_lenght": [2]}))
    # A contradiction TrainRecipe refuses (window shorter than the unroll) is caught at expansion.
    with pytest.raises(RecipeError, match="(?s)for sweep point ttt_length=9-.*sliding_window=8 is smaller than ttt_length=9"):
        expand(sweep(tmp_path, grid={"ttt_length": [2, 9]}))


def test_recipe_file_grid_flags_and_base_relative_to_the_recipe(tmp_path, monkeypatch):
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(tiny_train_base("some/store")))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "base": "train.yaml", "grid": {"ttt_length": [2, 3]}, "output_dir": str(tmp_path / "out"),
    }))
    monkeypatch.chdir(REPO)  # train.yaml is not in the working directory: found beside the recipe
    recipe = load_sweep_recipe(tmp_path / "sweep.yaml", ["executor=ray"], {"draft.intermediate_size": [64, 128]})
    assert recipe.base == str(tmp_path / "train.yaml") and recipe.executor == "ray"
    assert recipe.grid == {"ttt_length": [2, 3], "draft.intermediate_size": [64, 128]}
    assert len(expand(recipe)) == 4
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump({"base": "nope.yaml", "output_dir": "x"}))
    with pytest.raises(RecipeError, match="training recipe .nope.yaml. not found"):
        load_sweep_recipe(tmp_path / "missing.yaml")


def test_reference_sweep_recipe_expands(monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_sweep_recipe(REPO / "recipes" / "reference" / "sweep.yaml")
    assert set(recipe.grid) == {"ttt_length", "candidate_head.rank", "candidate_head.num_candidates"}
    assert recipe.stages == ["draft", "candidate_head"]
    points = expand(recipe)
    assert len(points) == len(recipe.grid["ttt_length"]) * len(recipe.grid["candidate_head.rank"]) * len(recipe.grid["candidate_head.num_candidates"])
    assert len({p.draft_name for p in points}) == len(recipe.grid["ttt_length"])
