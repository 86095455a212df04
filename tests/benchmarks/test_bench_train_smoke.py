"""``python -m benchmarks.bench_train`` at a tiny size on the CPU (store vs online throughput and the
bf16-vs-fp8 quality run both come out), the ``step-modes`` mode likewise, and the ``profile``
mode's GPU-idle summary on a hand-made trace (the profile itself needs CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.paths import TRAIN_DATA


@pytest.mark.slow
def test_tiny_cpu_run_times_both_feeds_and_trains_both_codecs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_train

    monkeypatch.setattr(bench_train, "TRAIN_DATA", TRAIN_DATA)  # the bundled slice on a clone without ../shared
    out = tmp_path / "train.json"
    argv = ["--device", "cpu", "--records", "6", "--max-length", "128", "--token-budget", "256", "--steps", "2",
            "--quality-steps", "2", "--draft-vocab", "256", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    assert bench_train.main(argv) == 0
    results = json.loads(out.read_text())
    for mode in ("store", "online"):
        assert results["throughput"]["reference"][mode]["tokens_per_s"] > 0
    assert set(results["quality"]) == {"bf16", "fp8_e4m3"}


@pytest.mark.slow
def test_step_modes_quick_fills_the_train_section_and_keeps_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``step-modes --quick``: both step variants timed (float32 and FP8, eager, the reference
    shape), the FP8-vs-bf16 held-out run, all merged into the results file's ``train`` section."""
    from benchmarks import bench_train
    from benchmarks.common import STEPS_IN_PROCESS_ENV

    monkeypatch.setattr(bench_train, "TRAIN_DATA", TRAIN_DATA)
    monkeypatch.setenv(STEPS_IN_PROCESS_ENV, "1")  # each variant here, not in a child process (~4 s of imports)
    out = tmp_path / "gpu-limit.json"
    out.write_text(json.dumps({"extract": {"compiled_tokens_per_s": 1.0}, "train": {"note": "kept"}}))
    assert bench_train.main(["step-modes", "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    results = json.loads(out.read_text())
    assert results["extract"] == {"compiled_tokens_per_s": 1.0}
    train = results["train"]
    assert train["note"] == "kept"
    assert train["all_scored_bf16_tokens_per_s"] > 0 and train["all_scored_fp8_tokens_per_s"] > 0
    assert set(train["step_variants"]) == {"eager+off", "eager+off+fp8"}
    assert all(row["back_to_back_tokens_per_s"] > 0 for row in train["step_variants"].values())
    assert train["all_scored_bf16_back_to_back_tokens_per_s"] > 0
    runs = train["heldout_quality"]["runs"]
    assert set(runs) == {"bf16", "fp8"} and all(len(run["held_out_acc"]) == 7 for run in runs.values())
    assert isinstance(train["fp8_heldout_acc_rel_delta"], float)


def test_step_modes_summary_picks_the_fastest_of_each_precision() -> None:
    from benchmarks.train.step_modes import summarize

    rows = {
        "flex+layers": {"variant": "flex+layers", "compile": "layers", "fp8": False, "tokens_per_s": 25_000},
        "flex+graph": {"variant": "flex+graph", "compile": "graph", "fp8": False, "tokens_per_s": 31_000},
        "flex+graph+fp8": {"variant": "flex+graph+fp8", "error": "RuntimeError: ..."},
        "flex+layers+fp8": {"variant": "flex+layers+fp8", "compile": "layers", "fp8": True, "tokens_per_s": 27_900},
        "flex+step": {"variant": "flex+step", "skipped": "deadline"},
    }
    summary = summarize(rows)
    assert summary["all_scored_bf16_tokens_per_s"] == 31_000 and summary["all_scored_bf16_variant"] == "flex+graph"
    assert summary["all_scored_fp8_tokens_per_s"] == 27_900 and summary["fp8_speedup"] == 0.9
    assert summary["layers_bf16_tokens_per_s"] == 25_000 and summary["step_variants"] is rows


def test_step_variants_parse_from_the_command_line() -> None:
    from benchmarks.train.profile_step import StepVariant
    from pipelines.train.compile_modes import CompileMode

    assert StepVariant.parse("flex+graph+fp8") == StepVariant("flex", CompileMode.GRAPH, True)
    assert StepVariant.parse("flex+compile") == StepVariant("flex", CompileMode.LAYERS, False)  # the old spelling
    assert StepVariant.parse("eager") == StepVariant("eager", CompileMode.OFF, False)
    assert str(StepVariant.parse("flex+step")) == "flex+step"


def test_a_variant_is_timed_step_by_step_and_back_to_back() -> None:
    """``run_variant`` on the CPU at a small size: the synced median and the back-to-back rate
    (one sync at the end, as the trainer runs), and the draft learns over both."""
    import argparse

    import torch

    from benchmarks.train.profile_step import StepVariant, run_variant

    args = argparse.Namespace(shape="reference", tokens=256, rows=1, draft_vocab=512, ttt_length=2, steps=2, warmup=1)
    row = run_variant(args, StepVariant.parse("eager"), torch.device("cpu"), None, None)
    assert row["variant"] == "eager+off" and row["tokens_per_step"] == 256
    assert row["tokens_per_s"] > 0 and row["back_to_back_tokens_per_s"] > 0
    assert row["back_to_back_step_ms"] == pytest.approx(256_000 / row["back_to_back_tokens_per_s"], rel=0.01)
    assert row["loss_last"] < row["loss_first"]


def test_idle_is_the_span_outside_the_union_of_kernel_intervals() -> None:
    from benchmarks.train.profile_step import gpu_idle

    events = [
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "b", "ts": 12, "dur": 8},  # a gap of 2 us after a
        {"cat": "gpu_memcpy", "name": "copy", "ts": 15, "dur": 2},  # inside b: no gap, no extra busy time
        {"cat": "kernel", "name": "c", "ts": 1_150, "dur": 50},  # a gap of 1.13 ms after b
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 20, "dur": 1_100},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
    ]
    summary = gpu_idle(events, steps=1)
    assert summary["kernels_per_step"] == 4 and summary["gaps_per_step"] == 2
    assert summary["span_ms_per_step"] == 1.2 and summary["busy_ms_per_step"] == 0.1  # 10 + 8 + 50 us
    assert summary["idle_fraction"] == round(1 - 68 / 1_200, 3)
    assert summary["idle_ms_per_step_by_gap"] == {"<10us": 0.0, "10-100us": 0.0, "0.1-1ms": 0.0, ">=1ms": 1.1}
    assert summary["host_syncs_per_step"] == 1.0
    assert [g["before"] for g in summary["longest_gaps"]] == ["c", "b"]


def test_step_variants_name_the_fp8_choices_and_refuse_unknown_ones() -> None:
    from benchmarks.train.profile_step import StepVariant

    for text, accum, all_linears in (("flex+graph+fp8", "forward", False), ("flex+graph+fp8:none", "none", False),
                                     ("eager+off+fp8all:all", "all", True)):
        variant = StepVariant.parse(text)
        assert (variant.fp8, variant.fp8_fast_accum, variant.fp8_all_linears) == (True, accum, all_linears)
        assert str(variant) == text
    assert StepVariant.parse("eager+off+fp8").fast_accum_table() == {"forward": True, "grad_input": False, "grad_weight": False}
    with pytest.raises(ValueError, match="fp8 accumulation 'some' is not one of"):
        StepVariant.parse("flex+graph+fp8:some")
    with pytest.raises(ValueError, match="'fp8mlp' is not fp8 or fp8all"):
        StepVariant.parse("flex+graph+fp8mlp")
