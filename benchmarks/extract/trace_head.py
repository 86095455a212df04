"""Read a worker's trace (``profiler.dir``, pipelines/extract/profiling.py) for where the start goes.

From the first unit's start (its ``hsstore.unit_setup`` range) it prints: when the host began each
traced batch and when the device ran its first kernel; the device's idle gaps longer than
``--gap-ms``, with the host's ranges at that time; and the longest host calls before the first
kernel (CUDA runtime calls, such as an allocation or a synchronisation, show there). On a CPU trace
there is no device timeline and only the host's part is printed.

    python -m benchmarks.bench_extract trace OUT/traces/extract-*.pt.trace.json.gz [--json summary.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def summarise(events: list[dict[str, Any]], gap_ms: float = 1.0, top: int = 8) -> dict[str, Any]:
    """Milliseconds from the unit's start; see the module docstring."""
    setups = [e for e in events if e["name"] == "hsstore.unit_setup" and e.get("cat") == "user_annotation"]
    if not setups:
        raise SystemExit("no hsstore.unit_setup range: not a trace from profiler.dir")
    t0 = float(min(e["ts"] for e in setups))

    def ms(ts: float) -> float:
        return round((ts - t0) / 1000.0, 3)

    batches = sorted((e for e in events if e["name"] == "hsstore.batch" and e.get("cat") == "user_annotation"),
                     key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    summary: dict[str, Any] = {
        "unit_setup_ms": round(max(e["dur"] for e in setups) / 1000.0, 3),
        "host_batches": [{"start_ms": ms(e["ts"]), "duration_ms": round(e["dur"] / 1000.0, 3)} for e in batches],
        "device": bool(device),
    }
    until = device[0]["ts"] if device else (batches[0]["ts"] if batches else t0)
    summary["longest_host_calls_before_first_kernel" if device else "longest_host_calls_before_first_batch"] = [
        {"name": e["name"], "cat": e["cat"], "start_ms": ms(e["ts"]), "duration_ms": round(e["dur"] / 1000.0, 3)}
        for e in sorted((e for e in host if t0 <= e["ts"] < until and not e["name"].startswith("hsstore.")),
                        key=lambda e: -e["dur"])[:top]
    ]
    if device:
        summary["first_kernel_ms"] = ms(device[0]["ts"])
        summary["first_kernel"] = device[0]["name"][:120]
        gaps = []
        busy_until = float(t0)
        for event in device:
            if event["ts"] - busy_until > gap_ms * 1000.0:
                during = sorted({e["name"] for e in host if e["name"].startswith("hsstore.")
                                 and e["ts"] < event["ts"] and e["ts"] + e["dur"] > busy_until})
                gaps.append({"from_ms": ms(busy_until), "to_ms": ms(event["ts"]),
                             "idle_ms": round((event["ts"] - busy_until) / 1000.0, 3), "host_in": during,
                             "next": event["name"][:80]})
            busy_until = max(busy_until, event["ts"] + event["dur"])
        summary["device_idle_gaps"] = gaps
        summary["device_idle_ms"] = round(sum(g["idle_ms"] for g in gaps), 3)
        summary["device_last_ms"] = ms(busy_until)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gap-ms", type=float, default=1.0, help="device idle gaps longer than this are listed")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = summarise(load_events(args.trace), args.gap_ms)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0

