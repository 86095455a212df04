"""bench_vs_specforge.py: its bookkeeping, and the speed mode end to end at a tiny shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_vs_specforge as bench


def test_split_is_stable_and_disjoint(tmp_path: Path) -> None:
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}", "text": "x"}) + "\n" for i in range(200)))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train_a, held_a = bench.split_records(source, tmp_path / "a")
    train_b, held_b = bench.split_records(source, tmp_path / "b")
    assert train_a.read_text() == train_b.read_text() and held_a.read_text() == held_b.read_text()
    train_ids = {json.loads(line)["id"] for line in train_a.read_text().splitlines()}
    held_ids = {json.loads(line)["id"] for line in held_a.read_text().splitlines()}
    assert not train_ids & held_ids and len(train_ids | held_ids) == 200
    assert 5 <= len(held_ids) <= 40  # ~10%


def run(acc0: float, tree: float, seed: int) -> dict:
    return {"seed": seed, "heldout_acc": [acc0, acc0 - 0.01], "al_chain5_t0": 1.5, "al_tree_t0": tree,
            "al_tree_t1": 1.4, "tokens_per_s": 100.0 + seed}


def test_medians_spreads_and_verdicts() -> None:
    ours = bench.aggregate([run(0.50, 2.0, 0), run(0.52, 2.2, 1), run(0.51, 2.1, 2)])
    assert ours["al_tree_t0"] == 2.1 and ours["al_tree_t0_spread"] == [2.0, 2.2]
    assert ours["heldout_acc"][0] == 0.51 and ours["heldout_acc_spread"][0] == [0.50, 0.52]
    close = bench.aggregate([run(0.515, 2.15, 0), run(0.52, 2.3, 1), run(0.50, 2.0, 2)])
    verdict = bench.verdicts(ours, close)
    assert verdict["al_tree_t0"] == "tie (within the seeds' spread)"
    assert verdict["heldout_acc0"] == "met"  # -1.0% relative, at the bound
    far = bench.aggregate([run(0.60, 3.0, 0), run(0.60, 3.0, 1), run(0.60, 3.0, 2)])
    assert bench.verdicts(ours, far) == pytest.approx({"al_tree_t0_ratio": 0.7, "al_tree_t0": "not met",
                                                     "heldout_acc0_rel_delta": 0.51 / 0.60 - 1, "heldout_acc0": "not met"})
    assert bench.verdicts(far, ours)["al_tree_t0"] == "met"


@pytest.mark.slow
def test_speed_mode_tiny_shape(tmp_path: Path) -> None:
    """Random features of a tiny shape through export-features, hsstore train and SpecForge's own
    trainer (a subprocess), both timed: the 8B run's code path on the CPU."""
    pytest.importorskip("specforge", reason="SpecForge is not installed (make peers)")
    pytest.importorskip("accelerate", reason="SpecForge's trainer imports accelerate (make peers)")
    out = tmp_path / "vs.json"
    argv = ["qwen3-8b", "--shape", "tiny", "--device", "cpu", "--steps", "5", "--token-budget", "128",
            "--workdir", str(tmp_path / "work"), "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())["qwen3_8b_shape_gpu"]
    assert result["hsstore_tokens_per_s"] > 0 and result["specforge_tokens_per_s"] > 0
    assert result["row_tokens"] == 128 and result["steps"] == 5
    assert result["aim_1_2x"] in ("met", "not met")
