"""``python -m benchmarks.bench_evaluate reference-draft`` at a tiny size: exported (untrained) drafts of two rungs
decode a prompt, and the report holds the keys issue 28 names (the numbers are measured in RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.paths import REFERENCE_TARGET

pytestmark = pytest.mark.slow


def export_untrained(folder: Path, seed: int, draft_vocab_size: int = 512) -> None:
    import torch

    from pipelines.export.serving import export_draft
    from pipelines.models.checkpoint import save_draft
    from pipelines.models.eagle3 import Eagle3Config, Eagle3Draft

    torch.manual_seed(seed)
    target_config = json.loads((REFERENCE_TARGET / "config.json").read_text())
    config = Eagle3Config.from_target_config(target_config, draft_vocab_size=draft_vocab_size, aux_layer_ids=[2, 4, 5])
    project = save_draft(Eagle3Draft(config), folder.with_name(folder.name + "-project"))
    export_draft(project, "eagle3", folder, dtype="float32")


def test_the_ladder_decodes_its_rungs_and_reports_the_issue_keys(tmp_path: Path) -> None:
    from benchmarks import bench_evaluate

    # The two rungs the report needs (raw, and greedy: the shipped one); every rung decodes alike.
    rungs = ("raw", "greedy")
    for seed, rung in enumerate(rungs):
        export_untrained(tmp_path / f"export-{rung}", seed)
        (tmp_path / f"export-{rung}" / "metrics.jsonl").write_text(
            json.dumps({"step": 5, "loss": 3.0}) + "\n" + json.dumps({"step": 6, "loss": 2.5}) + "\n"
        )
        (tmp_path / f"export-{rung}" / "store-info.txt").write_text("store      x\nsamples    1,234\ntokens     56,789\n")
    common = ["--drafts", str(tmp_path), "--limit", "1", "--max-new-tokens", "4", "--rungs", ",".join(rungs)]
    assert bench_evaluate.main(["reference-draft", *common]) == 0
    out = tmp_path / "reference-draft.json"
    out.write_text(json.dumps({"acceptance_ceiling": {"kept": True}, "al_tree_t0": 0.0}))  # an earlier file
    assert bench_evaluate.main(["reference-draft", *common, "--report", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["acceptance_ceiling"] == {"kept": True}  # what another benchmark wrote stays
    for key in ("al_tree_t0", "al_chain5_t0", "al_tree_t1", "raw_data_al_tree_t0"):
        assert report[key] >= 1.0
    assert report["steps"] == 6 and report["train_records"] == 1234
    assert set(report["ladder"]) == set(rungs)
    assert report["ladder"]["raw"]["train_tokens"] == 56789
