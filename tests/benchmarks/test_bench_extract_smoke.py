"""``python -m benchmarks.bench_extract`` at a tiny size on the CPU: the in-process comparison with a
bare forward, the ``ray`` mode (in-process executor, no split) with issue 13's keys, and the
``trace`` mode on a hand-made trace. Speeds are not checked (they live in benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.extract.trace_head import load_events, summarise
from tests.support.paths import REPO_ROOT


@pytest.mark.slow
def test_tiny_cpu_run_compares_extraction_with_the_bare_forward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import bench_extract

    out = tmp_path / "extract.json"
    argv = ["--models", "small", "--device", "cpu", "--dtype", "float32", "--tokens", "1024", "--min-length", "64",
            "--max-length", "256", "--token-budget", "512", "--unit-tokens", "1024", "--store-dir", str(tmp_path), "--out", str(out)]
    assert bench_extract.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["model"] == "small" and row["bare_tokens_per_s"] > 0 and row["extract_tokens_per_s"] > 0
    assert row["store_bytes_per_token"] > 0
    assert "| small (float32, bf16) |" in capsys.readouterr().out


def run_in_process(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """``python -m benchmarks.bench_extract ARGV``'s ``main`` in this process (~4 s of imports and
    Ray's version check saved a run). Its steps (prepare, bare, each extraction), which start
    processes of their own on a GPU, run here too (``STEPS_IN_PROCESS_ENV``: ~3.5 s of imports
    saved a step). Its stdout."""
    from benchmarks import bench_extract
    from benchmarks.common import STEPS_IN_PROCESS_ENV

    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv(STEPS_IN_PROCESS_ENV, "1")
    capsys.readouterr()
    assert bench_extract.main(argv) == 0
    return capsys.readouterr().out


def run_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
             *extra: str) -> tuple[str, dict]:
    """The benchmark at a tiny size on the CPU; its stdout and the extract-h200.json it wrote."""
    argv = [
        "ray", "run", "--shape", "small", "--device", "cpu",
        "--executor", "local", "--gpus", "1", "--tokens", "1500", "--min-length", "64", "--max-length", "200",
        "--max-length-cap", "256", "--token-budget", "512", "--unit-tokens", "1024", "--disk-gib", "0.005",
        "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *extra,
    ]
    stdout = run_in_process(argv, capsys, monkeypatch)
    return stdout, json.loads((tmp_path / "out" / "extract-h200.json").read_text())


@pytest.mark.slow
def test_tiny_cpu_run_writes_the_issue_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # One extraction run (fp8-1's key is the sequence test's). Its steps run in this process, as
    # every smoke run's here; tests/benchmarks/test_common.py runs a step both ways.
    stdout, results = run_tiny(tmp_path, capsys, monkeypatch, "--runs", "bf16-1")
    assert results["bare_tokens_per_s"] > 0 and results["disk_gb_per_s"] > 0
    assert results["ray"]["bf16"]["gpus_1"] > 0
    assert results["ray"]["fp8_e4m3"]["gpus_1"] is None and results["ray"]["bf16"]["gpus_2"] is None  # not run
    assert results["num_tokens"] == results["bare"]["num_tokens"]  # the same batches, both sides
    assert 0 <= results["padding_fraction"] < 0.5
    assert "| bf16-1 |" in stdout and "| fp8-1 |" not in stdout


@pytest.mark.slow
def test_tiny_cpu_sequence_compares_each_run_with_the_bare_passes_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stdout, results = run_tiny(tmp_path, capsys, monkeypatch, "--sequence", "bare,fp8-1,bare,fp8-1-trace",
                               "--trace-batches", "2")
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
    head = summarise(load_events(traces[0]))  # bench_extract's trace mode reads it (no device on a CPU)
    assert len(head["host_batches"]) == 2 and head["device"] is False
    assert results["ray"]["fp8_e4m3"]["gpus_1"] == run["tokens_per_second"]
    assert "| fp8-1 |" in stdout
    assert not (tmp_path / "work" / "stores").exists()  # each run's store deleted after it


@pytest.mark.slow
def test_tiny_cpu_gpu_limit_run_writes_the_extract_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31's mode: bare, eager and compiled extraction, compiled vs eager on the same batches;
    report --write keeps the train section. Compiled with aot_eager: the same dynamo graph, the
    same background compile and switch-over, without inductor's C++ kernels (~20 s cold on 2 cores;
    test_compiled_layers.py extracts through inductor's kernels)."""
    out = tmp_path / "out"
    argv = [
        "gpu-limit", "run", "--shape", "small", "--device", "cpu",
        "--executor", "local", "--tokens", "800", "--min-length", "64", "--max-length", "200", "--max-length-cap", "256",
        "--token-budget", "512", "--unit-tokens", "1024", "--planning-workers", "1", "--out", str(out),
        "--work", str(tmp_path / "work"), "--runs", "eager,compiled",  # default: the same extraction, another setting
        "--compile-backend", "aot_eager",
    ]
    run_in_process(argv, capsys, monkeypatch)
    measured = json.loads((out / "gpu-limit-extract.json").read_text())
    extract, runs = measured["extract"], measured["details"]["runs"]
    assert set(extract) == {"bare_hf_tokens_per_s", "eager_tokens_per_s", "compiled_tokens_per_s", "max_feature_rel_err",
                            "job_wall_seconds_1m_tokens", "first_forward_seconds", "model_load_seconds"}
    # aot_eager runs eager kernels, so its features may equal the eager run's exactly (error 0).
    assert all(value is not None and (value > 0 or key == "max_feature_rel_err") for key, value in extract.items()), extract
    assert 0 <= extract["max_feature_rel_err"] < 4e-2  # bf16 rounding, not another computation
    details = measured["details"]  # compiled no further from the float32 forward than eager
    assert 0 < details["compiled_vs_float32_rel_err"] < 1.5 * details["eager_vs_float32_rel_err"] + 2e-3
    assert runs["bf16-1"]["compiled"] is False and runs["bf16-1-compiled"]["compiled"] is True
    assert runs["bf16-1-compiled"]["compiled_graphs"] == 1
    assert extract["first_forward_seconds"] <= extract["job_wall_seconds_1m_tokens"]
    assert not (tmp_path / "work" / "stores").exists()  # both stores deleted

    # The reports in this process too: a JSON merge and a table, each ~3.7 s of imports as a process.
    results = tmp_path / "gpu-limit-h200.json"
    results.write_text(json.dumps({"train": {"all_scored_bf16_tokens_per_s": 1.0}}))
    report = ["gpu-limit", "report", str(out / "gpu-limit-extract.json"), "--write", "--results", str(results)]
    assert "| compiled / bare HF forward |" in run_in_process(report, capsys, monkeypatch)
    merged = json.loads(results.read_text())
    assert merged["extract"] == extract and merged["train"] == {"all_scored_bf16_tokens_per_s": 1.0}

    # A later run of some of the extractions (--runs default) keeps the others' figures, and says so.
    later = json.loads((out / "gpu-limit-extract.json").read_text())
    later["extract"]["compiled_tokens_per_s"] = later["details"]["compiled_vs_bare"] = None
    later["extract"]["first_forward_seconds"], later["date"] = 1.5, "later"
    (out / "later.json").write_text(json.dumps(later))
    report[2] = str(out / "later.json")
    run_in_process(report, capsys, monkeypatch)
    merged = json.loads(results.read_text())
    assert merged["extract"]["compiled_tokens_per_s"] == extract["compiled_tokens_per_s"]
    assert merged["extract"]["first_forward_seconds"] == 1.5
    assert merged["extract_details"]["compiled_vs_bare"] == details["compiled_vs_bare"]
    assert merged["extract_details"]["carried_from_earlier_runs"] == {"compiled_tokens_per_s": measured["date"]}


# -- the trace mode, on a small GPU-shaped trace: the device's first kernel, its idle gaps with the
# host ranges at that time, and the longest host calls before the first kernel.


def _event(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_first_kernel_gaps_and_the_host_calls_before_it() -> None:
    events = [
        _event("hsstore.unit_setup", "user_annotation", 1_000, 500),
        _event("hsstore.batch", "user_annotation", 1_500, 6_000),
        _event("cudaHostAlloc", "cuda_runtime", 1_600, 800),
        _event("aten::mm", "cpu_op", 2_450, 50),
        _event("gemm_kernel", "kernel", 2_600, 100),
        _event("hsstore.sink_submit", "user_annotation", 3_000, 1_500),
        _event("Memcpy DtoH", "gpu_memcpy", 5_000, 200),  # 2.3 ms after the kernel ended
        _event("gemm_kernel", "kernel", 5_300, 100),  # 0.1 ms after the copy: not a gap
    ]
    summary = summarise(events, gap_ms=1.0)
    assert summary["device"] is True
    assert summary["unit_setup_ms"] == 0.5
    assert summary["host_batches"] == [{"start_ms": 0.5, "duration_ms": 6.0}]
    assert summary["first_kernel_ms"] == 1.6 and summary["first_kernel"] == "gemm_kernel"
    calls = summary["longest_host_calls_before_first_kernel"]
    assert [c["name"] for c in calls] == ["cudaHostAlloc", "aten::mm"]
    # The device idle from the unit's start to the first kernel, then between the kernel and the copy.
    assert [(g["from_ms"], g["to_ms"]) for g in summary["device_idle_gaps"]] == [(0.0, 1.6), (1.7, 4.0)]
    assert summary["device_idle_gaps"][1]["host_in"] == ["hsstore.batch", "hsstore.sink_submit"]
    assert summary["device_idle_ms"] == 3.9 and summary["device_last_ms"] == 4.4
