"""The stage plugins: what each reads per teacher mode, how it weighs depths, what its logs say;
the loader settings the trainer builds once and passes whole. The loop itself runs in test_trainer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipelines.train.config import TrainRecipe
from pipelines.train.data import LoaderSettings
from pipelines.train.distributed import Distributed
from pipelines.train.metrics import (
    CANDIDATE_HEAD_METRICS,
    DRAFT_METRICS,
    MetricsWindow,
    summary_text,
)
from pipelines.train.objective import ObjectiveOutput
from pipelines.train.stages import STAGES, CandidateHeadStage, DraftStage, stage_for
from pipelines.train.teacher_mode import TeacherMode

BASE: dict[str, Any] = {"store": "s", "target": "t", "output_dir": "o"}
STAGE2 = {**BASE, "stage": "candidate_head", "candidate_head": {"draft_checkpoint": "ckpt"}}


def test_the_recipe_picks_the_plugin() -> None:
    assert set(STAGES) == {"draft", "candidate_head"}
    assert isinstance(stage_for(TrainRecipe.model_validate(BASE)), DraftStage)
    assert isinstance(stage_for(TrainRecipe.model_validate({**BASE, "model": "eagle4"})), DraftStage)
    assert isinstance(stage_for(TrainRecipe.model_validate(STAGE2)), CandidateHeadStage)


@pytest.mark.parametrize("teacher", list(TeacherMode))
def test_features_read_per_teacher_mode(teacher: TeacherMode) -> None:
    draft = stage_for(TrainRecipe.model_validate(BASE))
    assert draft.features(teacher) == ["aux_hidden_states", *teacher.features]
    # Stage 2's teacher is the frozen draft's own head: no stored distribution is read.
    assert stage_for(TrainRecipe.model_validate(STAGE2)).features(teacher) == ["aux_hidden_states"]


def test_continued_draft_is_init_from_or_the_stage1_checkpoint() -> None:
    assert stage_for(TrainRecipe.model_validate(BASE)).continued_draft() is None
    assert stage_for(TrainRecipe.model_validate({**BASE, "init_from": "pre"})).continued_draft() == "pre"
    stage2 = stage_for(TrainRecipe.model_validate(STAGE2))
    assert stage2.continued_draft() == "ckpt"
    assert stage2.continued_aux_layer_ids() is None  # not a directory: nothing to compare


def test_the_draft_objective_gets_the_recipe_compile_mode_and_fp8() -> None:
    from pipelines.train.compile_modes import CompileMode
    from pipelines.train.fp8 import Float8Linear
    from tests.support.models import build_draft, tiny_draft_config

    cpu = torch.device("cpu")
    stage = stage_for(TrainRecipe.model_validate({**BASE, "fp8": True}))
    draft = build_draft(tiny_draft_config())
    objective = stage.build_objective(draft, TeacherMode.DRAFT_PROBS, None, cpu)  # type: ignore[arg-type]
    assert objective.compile_mode == CompileMode.OFF  # auto on the CPU
    assert isinstance(draft.midlayer.mlp.down_proj, Float8Linear) and not isinstance(draft.lm_head, Float8Linear)
    stage = stage_for(TrainRecipe.model_validate({**BASE, "compile": "on"}))
    objective = stage.build_objective(build_draft(tiny_draft_config()), TeacherMode.DRAFT_PROBS, None, cpu)  # type: ignore[arg-type]
    assert objective.compile_mode == CompileMode.LAYERS and objective.attention == "auto"


def _output(loss_sums: list[float]) -> ObjectiveOutput:
    tensors = [torch.tensor(v, dtype=torch.float64) for v in loss_sums]
    return ObjectiveOutput(tensors, [torch.tensor(4.0)] * len(tensors), [torch.tensor(2.0)] * len(tensors))


def test_stage2_normalises_the_depth_weights() -> None:
    out, counts = _output([4.0, 8.0]), torch.tensor([4.0, 4.0], dtype=torch.float64)
    draft = stage_for(TrainRecipe.model_validate({**BASE, "loss_decay": 0.5}))
    stage2 = stage_for(TrainRecipe.model_validate({**STAGE2, "loss_decay": 0.5}))
    assert float(draft.loss(out, counts, world_size=1)) == pytest.approx(1.0 + 0.5 * 2.0)
    assert float(stage2.loss(out, counts, world_size=1)) == pytest.approx((1.0 + 0.5 * 2.0) / 1.5)


def test_metrics_records_name_what_the_stage_measures() -> None:
    records = {}
    for metrics in (DRAFT_METRICS, CANDIDATE_HEAD_METRICS):
        window = MetricsWindow(metrics)
        window.add_micro_batch(torch.tensor(1.0), _output([2.0, 6.0]), num_tokens=8, num_padding=0, wait_s=0.0)
        window.end_step(torch.tensor(0.5))
        records[metrics] = window.reduce(step=1, lr=1e-3, epoch=0, dist_state=Distributed())
    assert records[DRAFT_METRICS]["acc"] == [0.5, 0.5]
    assert "recall" not in records[DRAFT_METRICS] and "kl" not in records[DRAFT_METRICS]
    stage2 = records[CANDIDATE_HEAD_METRICS]
    assert stage2["recall"] == stage2["acc"] == [0.5, 0.5] and stage2["kl"] == [0.5, 1.5]
    summary = {"final_acc": [0.5], "interrupted": False, "steps": 1, "total_steps": 1, "tokens": 8,
               "tokens_per_s": 8.0, "data_wait_frac": 0.0, "padding_frac": 0.0, "final_loss": 1.0, "checkpoint": "c"}
    assert "per-depth recall@K 0.500" in summary_text(summary, CANDIDATE_HEAD_METRICS.accuracy_label)
    assert "per-depth acc 0.500" in summary_text(summary)


def test_loader_settings_come_whole_from_the_recipe_and_the_run() -> None:
    recipe = TrainRecipe.model_validate(
        {**BASE, "seed": 3, "skip_corrupt": True, "aux_layer_ids": [5, 2],
         "loader": {"token_budget": 512, "rows_per_batch": 2, "read_threads": 3, "remainder": "wrap"}}
    )
    store: Any = SimpleNamespace(lineage=SimpleNamespace(aux_layer_ids=[2, 4, 5]))
    settings = LoaderSettings.from_recipe(recipe, store, Distributed(rank=1, world_size=2), torch.device("cpu"))
    assert settings.loader_kwargs() == {
        "token_budget": 512, "rows_per_batch": 2, "seed": 3, "shuffle_window": 1024, "rank": 1, "world_size": 2,
        "remainder": "wrap", "long_samples": "error", "read_threads": 3, "prefetch_batches": None,
        "skip_corrupt": True, "decode_on_host": True, "layers": {"aux_hidden_states": [2, 0]},
    }
