"""``python -m benchmarks.bench_evaluate ceiling`` at a tiny size: two probe prompts built from a
folder of Python files, the target's greedy answers, their store, a two-step fine-tune of an
untrained "shipped" draft, both drafts decoded and scored, and the report merged into a results
file whose other keys stay as they were (the numbers are measured in RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.test_bench_reference_draft_smoke import export_untrained
from tests.support.paths import TRAIN_SLICE

pytestmark = pytest.mark.slow


def write_sources(folder: Path) -> None:
    """Python files long enough to give chat prompts (the builder alternates by path hash)."""
    folder.mkdir()
    for index in range(12):
        body = "".join(
            f"def function_{index}_{n}(value):\n    \"\"\"Return value plus {n}.\"\"\"\n    return value + {n}\n\n\n"
            for n in range(12)
        )
        (folder / f"module_{index}.py").write_text(f'"""Module {index}."""\n\n' + body)


def test_the_ceiling_runs_every_stage_and_merges_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_evaluate
    from benchmarks.common import STEPS_IN_PROCESS_ENV

    # generate, extract and train through the CLI's main in this process, not three processes
    # (~3.5 s of imports each; tests/benchmarks/test_common.py runs a step both ways).
    monkeypatch.setenv(STEPS_IN_PROCESS_ENV, "1")

    sources, work, shipped = tmp_path / "sources", tmp_path / "work", tmp_path / "shipped"
    write_sources(sources)
    export_untrained(shipped, seed=0, draft_vocab_size=2048)  # the training recipe's vocabulary size
    raw = tmp_path / "raw"
    export_untrained(raw, seed=1, draft_vocab_size=2048)
    reserved = tmp_path / "reserved.sha256"
    reserved.write_text("# no reserved files\n")
    out = tmp_path / "reference-draft.json"
    out.write_text(json.dumps({
        "al_tree_t0": 3.0, "shipped_rung": "greedy",
        "ladder": {"raw": {"al_tree_t0": 2.5, "al_chain5_t0": 2.0}, "greedy": {"al_tree_t0": 3.0, "al_chain5_t0": 2.2}},
    }))
    common = ["ceiling", "--work", str(work), "--num-prompts", "2", "--skip-files", "0", "--source-root", str(sources),
              "--reserved", str(reserved), "--exclude-sources", str(TRAIN_SLICE), "--shipped", str(shipped),
              "--raw-draft", str(raw),
              # Both ~250-token samples fit one 512-token row: the same two steps (the same loss) as
              # at the extraction's 2,048, without three quarters of each row padding (~4 s a step on 2 cores).
              "--answer-tokens", "6", "--max-new-tokens", "4", "--train-steps", "2", "--token-budget", "512",
              "--out", str(out)]
    assert bench_evaluate.main(common) == 0
    stages = json.loads((work / "stages.json").read_text())
    assert stages["probe"]["prompts"] == 2 and stages["extract"]["samples"] == 2
    assert stages["contexts"]["prompt_ids_equal"] == 2
    assert stages["train"]["steps"] == 2 and stages["train"]["train_acc_per_depth_by_epoch"]
    assert len(stages["accuracy"]["ceiling"]["accuracy_per_depth"]) == 7
    assert len(stages["accuracy"]["raw"]["accuracy_per_depth"]) == 7

    assert bench_evaluate.main([*common, "--report"]) == 0
    results = json.loads(out.read_text())
    assert results["al_tree_t0"] == 3.0 and results["ladder"]["raw"]["al_tree_t0"] == 2.5  # kept as they were
    ceiling = results["acceptance_ceiling"]
    for draft in ("ceiling", "shipped", "raw"):
        assert ceiling["acceptance_length"][draft]["al_tree_t0"] >= 1.0
        assert ceiling["acceptance_length"][draft]["al_chain5_t0"] >= 1.0
    assert set(ceiling["measured_ratios"]) == {
        f"{ratio}_{setting}" for ratio in ("ceiling_over_shipped", "ceiling_over_raw", "shipped_over_raw")
        for setting in ("chain5_t0", "tree_t0")
    }
    al = ceiling["acceptance_length"]
    assert ceiling["measured_ratios"]["ceiling_over_raw_tree_t0"] == round(al["ceiling"]["al_tree_t0"] / al["raw"]["al_tree_t0"], 3)
    versus_raw = ceiling["versus_raw_data_draft"]["tree_t0"]
    assert versus_raw["raw_on_eval"] == 2.5 and versus_raw["aim_1_3x_raw"] == 3.25
    assert {"ceiling_on_eval_estimate", "over_raw_estimate", "ceiling_on_probe_over_raw_on_eval"} <= set(versus_raw)
    assert ceiling["steps"]["generate"]["answers"] == 2 and "contexts" in ceiling["steps"]


def test_without_a_raw_draft_the_default_drafts_leave_it_out() -> None:
    """``--stages decode`` or ``accuracy`` without ``--raw-draft`` measures ceiling and shipped (naming
    ``--drafts raw`` without it is an error)."""
    import argparse

    from benchmarks.evaluate import ceiling

    assert ceiling.drafts_to_measure(argparse.Namespace(raw_draft=None)) == ["ceiling", "shipped"]
    assert ceiling.drafts_to_measure(argparse.Namespace(raw_draft=Path("raw"))) == ["ceiling", "shipped", "raw"]
    with pytest.raises(SystemExit, match="--raw-draft"):
        ceiling.draft_path(argparse.Namespace(raw_draft=None), "raw")
