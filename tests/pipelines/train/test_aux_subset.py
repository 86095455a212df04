"""One extraction with a superset of aux layers, a draft trained on any subset (issue 15).

The reference target is extracted once with six aux layers, one Zarr array per layer; a training
recipe's ``aux_layer_ids`` picks three of them. The draft's fc takes 3 x H inputs, its config, the
export and ``hsstore info`` carry the ids, and a subset the store does not hold is refused with the
ids it does hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hsstore
from hsstore.errors import AuxLayerError
from pipelines.train import run_training
from tests.support.paths import REFERENCE_TARGET

from .test_trainer import small_recipe

pytestmark = pytest.mark.slow

CAPTURED = [1, 2, 3, 4, 5, 6]


@pytest.fixture(scope="module")
def superset_store(tmp_path_factory: pytest.TempPathFactory, records_path: Path) -> str:
    from pipelines.extract import ExtractRecipe, run_extraction
    from pipelines.recipe import build_recipe

    # One array per aux layer (codecs.aux_hidden_states.layer_arrays).
    split = str(tmp_path_factory.mktemp("superset-split") / "store")
    recipe = build_recipe(ExtractRecipe, {}, [
        f"target={REFERENCE_TARGET}",
        f"data=[{records_path}]", f"store={split}", "limit=8", "executor=local",
        "model.dtype=float32", "model.device=cpu", f"capture.aux_layer_ids=[{','.join(map(str, CAPTURED))}]",
        "codecs.aux_hidden_states.layer_arrays=true", "batching.max_length=256", "batching.too_long=truncate",
        "batching.token_budget=2048", "units.max_tokens=2048",
    ])
    run_extraction(recipe)
    return split


def test_info_lists_the_captured_layers_and_the_layout(superset_store: str) -> None:
    info = hsstore.open_store(superset_store).info()
    assert info["lineage"]["aux_layer_ids"] == CAPTURED
    assert info["features"]["aux_hidden_states"]["shape"][1] == len(CAPTURED)


def test_a_draft_trains_on_three_of_six_layers_and_carries_their_ids(superset_store: str, tmp_path: Path) -> None:
    from pipelines.export.serving import export_draft
    from pipelines.models.checkpoint import load_draft

    recipe = small_recipe(superset_store, tmp_path / "run", max_steps=2, aux_layer_ids=[5, 2, 4])
    summary = run_training(recipe)
    draft = load_draft(summary["checkpoint"])
    assert list(draft.config.aux_layer_ids) == [5, 2, 4]
    assert tuple(draft.fc.weight.shape) == (384, 3 * 384)
    out = export_draft(summary["checkpoint"], "eagle3", tmp_path / "export")
    exported = json.loads((out / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [5, 2, 4]


def test_a_layer_the_store_lacks_is_refused_with_the_available_ids(superset_store: str, tmp_path: Path) -> None:
    recipe = small_recipe(superset_store, tmp_path / "bad", max_steps=1, aux_layer_ids=[2, 7])
    with pytest.raises(AuxLayerError, match=r"\[7\] are not in the store: it holds aux layers \[1, 2, 3, 4, 5, 6\]"):
        run_training(recipe)


def test_an_eagle31_draft_on_a_layer_subset_trains_exports_for_speculators_and_evaluates(
    superset_store: str, tmp_path: Path, shared_data: Path
) -> None:
    """Issue 30: a draft on [1, 4, 6] of the captured [1..6] (speculators' default for this
    8-layer target is [2, 4, 5]) with EAGLE-3.1's norms, trained, exported as speculators' format
    (verifier and ids from the run), loaded by speculators' own model class with a forward equal to
    ours, and evaluated from its checkpoint and from the export."""

    from pipelines.evaluate import EvaluateRecipe, run_evaluation
    from pipelines.export.serving import export_draft
    from pipelines.models.checkpoint import load_draft
    from pipelines.recipe import build_recipe
    from tests.pipelines.export.test_speculators import (
        assert_forward_equals_speculators,
        speculators_model_class,
    )

    record = json.loads((shared_data / "eval_prompts.jsonl").read_text().splitlines()[0])
    record["messages"] = [{**m, "content": m["content"][:240]} for m in record["messages"]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(record) + "\n")
    recipe = small_recipe(
        superset_store, tmp_path / "run", max_steps=2, aux_layer_ids=[1, 4, 6],
        draft={"fc_norm": True, "norm_output": True},
    )
    summary = run_training(recipe)
    draft = load_draft(summary["checkpoint"])
    assert draft.config.fc_norm and draft.config.norm_output and draft.fc_norm is not None
    out = export_draft(tmp_path / "run", "speculators", tmp_path / "export", dtype="float32")
    exported = json.loads((out / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    assert exported["speculators_config"]["verifier"]["name_or_path"] == str(REFERENCE_TARGET.resolve())

    for source in (summary["checkpoint"], out):
        evaluation = build_recipe(EvaluateRecipe, {
            "target": str(REFERENCE_TARGET), "draft": str(source), "prompts": str(prompts),
            "output_dir": str(tmp_path / "eval" / Path(source).name), "limit": 1, "max_new_tokens": 6,
            "baseline": False, "device": "cpu", "warmup_tokens": 0,
            "settings": [{"draft_top_k": 8, "draft_depth": 5, "total_draft_tokens": 31}],
        }, [])
        results = run_evaluation(evaluation)
        assert results["settings"][0]["acceptance_length"] >= 1.0

    model = speculators_model_class().from_pretrained(str(out)).eval()
    assert model.config.eagle_aux_hidden_state_layer_ids == [1, 4, 6]
    draft = draft.float()
    assert_forward_equals_speculators(draft, model)
