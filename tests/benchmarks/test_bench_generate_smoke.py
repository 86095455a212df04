"""benchmarks/bench_generate.py at a tiny size on the CPU: both paths timed, the same tokens counted."""

from __future__ import annotations

import json
from pathlib import Path


def test_quick_run_measures_both_paths(tmp_path: Path) -> None:
    from benchmarks import bench_generate

    out = tmp_path / "generate.json"
    assert bench_generate.main(["--quick", "--variants", "engine,no-cudnn,dynamic", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hsstore_tokens_per_s"] > 0 and result["plain_generate_tokens_per_s"] > 0
    assert result["batch"] == 8 and result["shape"] == "tiny"
    # Greedy on the same model and prompts: both paths generate the same number of tokens.
    assert result["hsstore_runs"][0]["tokens"] == result["plain_runs"][0]["tokens"] > 0
    # Every variant of hsstore's path timed, the first reported as hsstore's figure.
    assert set(result["variants"]) == {"engine", "no-cudnn", "dynamic"}
    assert result["variants"]["engine"]["runs"] == result["hsstore_runs"]
    for variant in ("no-cudnn", "dynamic"):
        assert result["variants"][variant]["runs"][0]["tokens"] == result["plain_runs"][0]["tokens"]


def test_quick_sampled_run_samples_on_both_paths(tmp_path: Path) -> None:
    from benchmarks import bench_generate

    out = tmp_path / "generate.json"
    assert bench_generate.main(["--quick", "--temperature", "1.0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["temperature"] == 1.0
    # 16 answers of at most 8 tokens on each path (a sampled stop id may end one early).
    assert 0 < result["hsstore_runs"][0]["tokens"] <= 128 and 0 < result["plain_runs"][0]["tokens"] <= 128
