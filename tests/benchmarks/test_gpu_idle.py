"""benchmarks/profile_train_step.py's GPU-idle summary on a hand-made trace (the profile itself needs CUDA)."""

from __future__ import annotations

from benchmarks.profile_train_step import gpu_idle


def test_idle_is_the_span_outside_the_union_of_kernel_intervals() -> None:
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
