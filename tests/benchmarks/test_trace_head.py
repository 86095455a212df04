"""benchmarks/trace_head.py on a small GPU-shaped trace: the device's first kernel, its idle gaps
with the host ranges at that time, and the longest host calls before the first kernel."""

from __future__ import annotations

from benchmarks.trace_head import summarise


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
