"""Host time from a unit's start to its first forward: a worker's first unit against its later ones,
with the warm-up as it was (the forward only) and as it is (the forward, then a few rows written
through a throwaway shard: ExtractionWorker._warm_write_path).

Why: on an H200 the GPU's first forward of a run started 0.85-1.2 s after the first unit began
(benchmarks/RESULTS.md, issue 13); this measures the host's part of that, which a CPU shows too.
Each mode runs in a fresh process (imports are what the first unit paid for), ``--repeats`` times,
alternating; medians.

    python -m benchmarks.investigations.profile_first_unit [--target DIR] [--device cpu|cuda] [--repeats 5]

Without ``--target`` a tiny random Qwen3 is built (the tests' builder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO_ROOT


def one_run(target: str, device: str, warm_write: bool, units: int) -> list[float]:
    """In this process: a worker, its warm-up (with or without the write path), ``units`` units;
    seconds from each unit's start to its first forward."""
    import numpy as np

    import hsstore
    from pipelines.extract.units import SampleRow, WorkUnit
    from pipelines.extract.worker import ExtractionWorker
    from pipelines.extract.worker_spec import WorkerSpec

    features = (
        hsstore.FeatureSpec(name="aux_hidden_states", shape=(3, 64), codec="fp8_e4m3"),
        hsstore.FeatureSpec(name="final_hidden_state", shape=(64,), codec="fp8_e4m3"),
    )
    store = Path(tempfile.mkdtemp(prefix="profile-first-unit-")) / "store"
    spec = WorkerSpec(target=target, store=str(store), features=features, aux_layer_ids=(1, 2, 3),
                      device=device, token_budget=512, max_length=128)
    if not warm_write:  # the warm-up as it was before the write path was added
        ExtractionWorker._warm_write_path = lambda self, features: None  # type: ignore[method-assign]
    worker = ExtractionWorker(spec)
    if device == "cpu":  # a CPU worker does not warm up by itself; warm it as a CUDA one does
        worker._on_compute_thread(worker.warm_up)
    starts: list[float] = []
    forward = worker._forward

    def timed(*args: object) -> object:
        starts.append(time.perf_counter())
        return forward(*args)

    worker._forward = timed  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    seconds = []
    for u in range(units):
        rows = tuple(
            SampleRow(f"u{u}s{i}", "r", rng.integers(3, 500, 100).astype(np.int32), np.ones(100, np.uint8))
            for i in range(8)
        )
        starts.clear()
        begun = time.perf_counter()
        worker.run_unit(WorkUnit(u, rows))
        seconds.append(starts[0] - begun)
    worker.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="a model directory (default: a tiny random Qwen3)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--units", type=int, default=3)
    parser.add_argument("--child", choices=["forward-only", "write-path"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the runs here (JSON)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.target, args.device, args.child == "write-path", args.units)))
        return 0
    target = args.target
    if target is None:
        from tests.pipelines.extract.conftest import build_tiny_target

        target = str(build_tiny_target(Path(tempfile.mkdtemp(prefix="profile-first-unit-target-")), "qwen3"))
    runs: dict[str, list[list[float]]] = {"forward-only": [], "write-path": []}
    for _ in range(args.repeats):
        for mode in runs:  # alternating, each in a fresh process
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.investigations.profile_first_unit", "--child", mode, "--target", target, "--device", args.device,
                 "--units", str(args.units)],
                cwd=REPO_ROOT, capture_output=True, text=True, check=True,
            )
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"host seconds from a unit's start to its first forward ({args.device}, median of {args.repeats} processes)")
    print("| warm-up | first unit | later units |")
    print("|---|---:|---:|")
    summary = {}
    for mode, per_run in runs.items():
        first = statistics.median(r[0] for r in per_run)
        later = statistics.median(x for r in per_run for x in r[1:])
        summary[mode] = {"first_unit_seconds": first, "later_units_seconds": later}
        print(f"| {mode} | {first * 1e3:.1f} ms | {later * 1e3:.1f} ms |")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs, "device": args.device,
                                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=2))
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
