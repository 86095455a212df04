"""The training recipe: shipped recipes load, contradictions are refused with the dotted key."""

from __future__ import annotations

import math

import pytest

from hsstore.aux_layers import TEACHER_FEATURES
from hsstore.errors import RecipeError
from pipelines.recipe import build_recipe, load_recipe
from pipelines.train.config import TrainRecipe
from pipelines.train.teacher_mode import TeacherMode
from pipelines.train.trainer import lr_at
from tests.support.paths import REPO_ROOT

BASE = {"store": "s", "target": "t", "output_dir": "o"}


@pytest.mark.parametrize(
    "path",
    [
        "recipes/reference/train-eagle3.yaml",
        "recipes/reference/train-eagle4.yaml",
        "recipes/reference/train-candidate-head.yaml",
        "recipes/qwen3/qwen3-8b-eagle3-train.yaml",
    ],
)
def test_shipped_recipes_load(path: str) -> None:
    recipe = load_recipe(TrainRecipe, REPO_ROOT / path, ["max_steps=5"])
    assert recipe.max_steps == 5 and recipe.ttt_length == 7
    if recipe.model == "eagle4" and recipe.stage == "draft":
        assert recipe.draft.sliding_window is not None


def test_contradictions_name_the_key() -> None:
    with pytest.raises(RecipeError, match=r"draft.sliding_window=4 is smaller than ttt_length=7"):
        build_recipe(TrainRecipe, {**BASE, "model": "eagle4"}, ["draft.sliding_window=4"])
    with pytest.raises(RecipeError, match=r"candidate_head.draft_checkpoint is required"):
        build_recipe(TrainRecipe, {**BASE, "stage": "candidate_head"})
    with pytest.raises(RecipeError, match=r"draft.vocab.*set exactly one of .*found draft_vocab_size, full"):
        build_recipe(TrainRecipe, BASE, ["draft.vocab.full=true", "draft.vocab.draft_vocab_size=10"])
    with pytest.raises(RecipeError, match=r"loader.token_budget: Input should be greater than 0"):
        build_recipe(TrainRecipe, BASE, ["loader.token_budget=0"])
    with pytest.raises(RecipeError, match=r"optimizer.lrr: unknown key"):
        build_recipe(TrainRecipe, BASE, ["optimizer.lrr=0.1"])
    with pytest.raises(RecipeError, match=r"store: Field required"):
        build_recipe(TrainRecipe, {"target": "t", "output_dir": "o"})


def test_compile_modes_and_fp8_contradictions_name_the_keys() -> None:
    recipe = build_recipe(TrainRecipe, BASE, ["compile=graph", "fp8=true"])
    assert recipe.compile == "graph" and recipe.fp8
    # YAML reads a bare on/off as a boolean; "on" is what it meant before the modes (layers).
    assert build_recipe(TrainRecipe, BASE, ["compile=on"]).compile == "on"
    assert build_recipe(TrainRecipe, BASE, ["compile=off"]).compile == "off"
    with pytest.raises(RecipeError, match=r"compile: graph does not accumulate gradients \(grad_accum_steps=2\)"):
        build_recipe(TrainRecipe, BASE, ["compile=graph", "grad_accum_steps=2"])
    with pytest.raises(RecipeError, match=r"compile: step traces the attention; attention: segmented"):
        build_recipe(TrainRecipe, BASE, ["compile=step", "attention=segmented"])
    with pytest.raises(RecipeError, match=r"fp8 and compile: step/graph apply to stage draft"):
        build_recipe(TrainRecipe, {**BASE, "stage": "candidate_head"},
                     ["candidate_head.draft_checkpoint=d", "fp8=true"])
    with pytest.raises(RecipeError, match=r"compile: Input should be 'auto', 'off', 'on', 'layers', 'step' or 'graph'"):
        build_recipe(TrainRecipe, BASE, ["compile=fast"])


def test_warmup_then_cosine() -> None:
    recipe = build_recipe(TrainRecipe, BASE, ["optimizer.lr=1.0", "schedule.warmup_steps=10", "schedule.min_lr_ratio=0.1"])
    lrs = [lr_at(step, 110, recipe) for step in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lr_at(110, 110, recipe) == pytest.approx(0.1)


def test_teacher_modes_are_one_enum_with_the_store_features() -> None:
    # Every mode of the target's distribution names the features hsstore says carry it, in the
    # order ``auto`` prefers them; ``tokens`` (the data's labels) reads none and comes last.
    assert [mode.value for mode in TeacherMode] == ["final_hidden", "topk", "draft_probs", "tokens"]
    assert {mode for mode in TeacherMode if mode.from_target} == set(TEACHER_FEATURES)
    assert TeacherMode.TOKENS.features == () and not TeacherMode.TOKENS.from_target
    assert TeacherMode.TOPK.features == ("topk_logits", "topk_ids")
    recipe = build_recipe(TrainRecipe, {**BASE, "teacher": "topk"})
    assert recipe.teacher is TeacherMode.TOPK and recipe.model_dump(mode="json")["teacher"] == "topk"
    assert build_recipe(TrainRecipe, BASE).teacher == "auto"
    with pytest.raises(RecipeError, match="teacher"):
        build_recipe(TrainRecipe, {**BASE, "teacher": "logits"})
