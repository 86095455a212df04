"""benchmarks/bench_extract_ray.py runs end to end at a tiny size on the CPU (in-process executor,
no split) and writes issue 13's keys; speeds are not checked (they live in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trace_head import load_events, summarise

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_tiny(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The benchmark at a tiny size on the CPU; its process and the extract-h200.json it wrote."""
    command = [
        sys.executable, "benchmarks/bench_extract_ray.py", "run", "--shape", "small", "--device", "cpu",
        "--executor", "local", "--gpus", "1", "--tokens", "1500", "--min-length", "64", "--max-length", "200",
        "--max-length-cap", "256", "--token-budget", "512", "--unit-tokens", "1024", "--disk-gib", "0.005",
        "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads((tmp_path / "out" / "extract-h200.json").read_text())


@pytest.mark.slow
def test_tiny_cpu_run_writes_the_issue_keys(tmp_path: Path) -> None:
    done, results = run_tiny(tmp_path)
    assert results["bare_tokens_per_s"] > 0 and results["disk_gb_per_s"] > 0
    assert results["ray"]["bf16"]["gpus_1"] > 0 and results["ray"]["fp8_e4m3"]["gpus_1"] > 0
    assert results["ray"]["bf16"]["gpus_2"] is None  # not run: --gpus 1
    assert results["num_tokens"] == results["bare"]["num_tokens"]  # the same batches, both sides
    assert 0 <= results["padding_fraction"] < 0.5
    assert "| bf16-1 |" in done.stdout and "| fp8-1 |" in done.stdout


@pytest.mark.slow
def test_tiny_cpu_sequence_compares_each_run_with_the_bare_passes_beside_it(tmp_path: Path) -> None:
    done, results = run_tiny(tmp_path, "--sequence", "bare,fp8-1,bare,fp8-1-trace", "--trace-batches", "2")
    assert [e["step"] for e in results["sequence"]] == ["bare", "fp8-1", "bare", "fp8-1-trace"]
    bare = [e["bare_tokens_per_s"] for e in results["sequence"] if e["step"] == "bare"]
    run = results["sequence"][1]
    # The run against the mean of the two bare passes beside it.
    assert run["vs_neighbouring_bare"] == pytest.approx(run["tokens_per_second"] / (sum(bare) / 2))
    # The traced run is a diagnostic: its trace under --out, and no ratio of it.
    assert results["sequence_ratios"] == {"fp8-1": [run["vs_neighbouring_bare"]]}
    assert "vs_neighbouring_bare" not in results["sequence"][3]
    traces = list((tmp_path / "out" / "traces").iterdir())
    assert [p.name.endswith(".pt.trace.json.gz") for p in traces] == [True]
    head = summarise(load_events(traces[0]))  # benchmarks/trace_head.py reads it (no device on a CPU)
    assert len(head["host_batches"]) == 2 and head["device"] is False
    assert results["ray"]["fp8_e4m3"]["gpus_1"] == run["tokens_per_second"]
    assert "| fp8-1 |" in done.stdout
    assert not (tmp_path / "work" / "stores").exists()  # each run's store deleted after it
