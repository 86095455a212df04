"""Evaluation refuses, before decoding anything, a draft that cannot fit the target.

The evaluation's own tests refuse misfit drafts held in memory and project checkpoints
(tests/pipelines/evaluate/test_drafter.py, test_runner.py). Here: *exported* drafts, the form a
user downloads from elsewhere, whose embeddings are the target's and so are checked by shape first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hsstore import HsstoreError
from tests.support.paths import REFERENCE_TARGET

pytestmark = pytest.mark.reliability


def exported_draft(tmp_path: Path, name: str, **overrides) -> Path:  # type: ignore[no-untyped-def]
    from pipelines.export.serving import export_draft
    from pipelines.models.checkpoint import save_draft
    from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft

    target_config = json.loads((REFERENCE_TARGET / "config.json").read_text())
    config = Eagle3Config.from_target_config(target_config, draft_vocab_size=512, aux_layer_ids=[2, 4, 5])
    draft = Eagle3Draft(config.model_copy(update=overrides))
    project = save_draft(draft, tmp_path / f"{name}-project")
    return export_draft(project, "eagle3", tmp_path / name, dtype="float32")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 4096}, r"embed_tokens has shape \(8192, 384\), the draft in .*small-vocab expects \(4096, 384\)"),
        # A draft exported for a 256-wide target (the exporter itself refuses hidden != target_hidden).
        ({"hidden_size": 256, "target_hidden_size": 256}, r"embed_tokens has shape \(8192, 384\), the draft in .*narrow expects \(8192, 256\)"),
    ],
    ids=["small-vocab", "narrow"],
)
def test_an_exported_draft_for_another_target_is_refused_before_decoding(tmp_path, overrides, message, request):
    from pipelines.evaluate.recipe import EvaluateRecipe
    from pipelines.evaluate.runner import run_evaluation
    from pipelines.recipe import build_recipe

    name = request.node.callspec.id
    draft_dir = exported_draft(tmp_path, name, **overrides)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "def add(a, b):"}\n')
    recipe = build_recipe(
        EvaluateRecipe,
        {"target": str(REFERENCE_TARGET), "draft": str(draft_dir), "prompts": str(prompts),
         "output_dir": str(tmp_path / "out"), "device": "cpu", "settings": [{"num_draft_tokens": 3}]},
    )
    with pytest.raises(HsstoreError, match=message):
        run_evaluation(recipe)
    assert not (tmp_path / "out").exists()  # nothing decoded, nothing written
