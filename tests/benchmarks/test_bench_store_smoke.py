"""The store benchmark runs end to end at a tiny size and produces its tables (numbers are not
checked against any speed: speed goals live in benchmarks/RESULTS.md, never in timed tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _load_bench():  # type: ignore[no-untyped-def]
    from benchmarks import bench_store

    return bench_store


def test_tiny_run_prints_tables_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    out = tmp_path / "results.json"
    workdir = tmp_path / "work"
    code = bench.main([
        "--hidden", "32", "--gib", "0.001", "--repeats", "1", "--write-repeats", "1",
        "--cold", "fadvise", "--mean-len", "100", "--max-len", "256", "--token-budget", "512",
        "--chunk-tokens", "64", "--workdir", str(workdir), "--out", str(out),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    layouts = [bench.BASELINE, *bench.STORE_CODECS]
    for layout in layouts:
        assert f"| {layout} |" in printed
    assert "| layout | write MB/s |" in printed
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["hidden"] == 32 and result["num_tokens"] > 0
    summary = result["summary"]
    assert sorted(summary) == sorted(layouts)
    for layout, row in summary.items():
        for key in ("write_mb_s", "write_tokens_s", "cold_tokens_s", "warm_tokens_s", "bytes_per_token"):
            assert row[key] > 0, (layout, key)
        if layout != bench.BASELINE:
            assert row["cold_bits_tokens_s"] > 0 and row["warm_bits_tokens_s"] > 0
            assert row["chunk_amplification"] >= 1.0
            # Every store epoch saw every token exactly once, like the baseline's.
            assert {run["tokens"] for run in result["runs"][layout]["warm"]} == {result["num_tokens"]}
    # The store's codecs do what they claim on disk: fp8 about halves bf16 (scales and the fixed
    # Arrow/Zarr overhead of a tiny store aside).
    assert summary["store fp8_e4m3"]["bytes_per_token"] < 0.75 * summary["store bf16"]["bytes_per_token"]
    assert not workdir.exists(), "the benchmark removes what it wrote unless --keep"


def test_refuses_a_budget_shorter_than_the_longest_sample(tmp_path: Path) -> None:
    bench = _load_bench()
    assert bench.main(["--hidden", "32", "--token-budget", "256", "--max-len", "512", "--workdir", str(tmp_path)]) == 2
