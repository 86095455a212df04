"""``hsstore verify`` with shards checked in threads vs one at a time, local and on moto S3, one run.

One synthetic bf16 store (``bench_object_store.write_store``) is written to a local folder and
copied into moto's S3 server on loopback (``tests/support/s3.py``); ``verify_store`` (every file's
size and sha256, every table and array header) runs on each with ``threads=1`` (what ``hsstore
verify`` did before) and with its default (the cores locally, the location's read threads on S3),
alternating, ``--repeats`` times; medians and their ratio are reported. The local store is read
from the page cache (it was just written), so the local row measures hashing, not a disk.

Usage: ``python -m benchmarks.bench_verify [--quick] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_object_store import range_reader, write_store
from benchmarks.common import machine_info, write_results
from hsstore.storage import StoreLocation
from hsstore.verify import verify_store
from tests.support.s3 import MotoS3, upload


def timed_verify(url: str, threads: int | None) -> dict[str, Any]:
    location = StoreLocation(url)
    started = time.perf_counter()
    problems = verify_store(location, threads=threads)
    seconds = time.perf_counter() - started
    if problems:
        raise SystemExit(f"{url}: the benchmark's store has problems: {problems[:3]}")
    return {"seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=131_072, help="tokens in the store (~8 KB each at H=1024)")
    parser.add_argument("--shard-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint-processes", type=int, default=1,
                        help="moto server processes once the store is uploaded (tests/support/s3.py, MotoS3.freeze)")
    parser.add_argument("--quick", action="store_true", help="a tiny run (4k tokens, 4 shards, 1 repeat)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.tokens, args.shard_tokens, args.repeats = 256, 4096, 1024, 1
    workdir = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    report: dict[str, Any] = {
        "command": " ".join(["bench_verify.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        with MotoS3(processes=args.endpoint_processes) as s3:
            s3.export()
            local = workdir / "store"
            report["store"] = write_store(local, hidden=args.hidden, num_tokens=args.tokens, mean_len=600,
                                          max_len=2048, shard_tokens=args.shard_tokens, seed=0)
            url = "s3://bench/store"
            upload(local, url)
            s3.freeze()  # N read-only server processes from here on (nothing for one)
            report["default_threads"] = {"local": os.cpu_count(), "s3": StoreLocation(url).read_threads}
            # s3_fsspec_1 is what `hsstore verify` did before: one shard at a time, every file through
            # s3fs. s3 (the default reader: obstore where installed) at one thread and at the default.
            runs: dict[str, list[dict[str, Any]]] = {
                "local_1": [], "local_default": [], "s3_fsspec_1": [], "s3_fsspec_default": [], "s3_1": [], "s3_default": []}
            for _ in range(args.repeats):
                runs["local_1"].append(timed_verify(str(local), 1))
                runs["local_default"].append(timed_verify(str(local), None))
                with range_reader("fsspec"):
                    runs["s3_fsspec_1"].append(timed_verify(url, 1))
                    runs["s3_fsspec_default"].append(timed_verify(url, None))
                with range_reader("auto"):
                    report["s3_reader"] = StoreLocation(url).range_reader
                    runs["s3_1"].append(timed_verify(url, 1))
                    runs["s3_default"].append(timed_verify(url, None))
            report["runs"] = runs
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    gb = report["store"]["bytes"] / 1e9
    summary: dict[str, Any] = {"store_gb": round(gb, 3), "shards": report["store"]["num_shards"]}
    for name, series in report["runs"].items():
        summary[f"{name}_seconds"] = round(statistics.median(r["seconds"] for r in series), 3)
    summary["local_speedup"] = round(summary["local_1_seconds"] / summary["local_default_seconds"], 2)
    summary["s3_speedup"] = round(summary["s3_fsspec_1_seconds"] / summary["s3_default_seconds"], 2)
    summary["s3_reader"] = report["s3_reader"]
    report["summary"] = summary
    print(f"\nstore: {gb:.2f} GB, {summary['shards']} shards; {report['machine']['nproc']} cores; medians of {args.repeats}")
    print("\n| verify | seconds | GB/s | vs before |")
    print("|---|---:|---:|---:|")
    rows = [("local, 1 thread (before)", "local_1", "local_1"),
            (f"local, {report['default_threads']['local']} threads (default)", "local_default", "local_1"),
            ("S3 through s3fs, 1 thread (before)", "s3_fsspec_1", "s3_fsspec_1"),
            (f"S3 through s3fs, {report['default_threads']['s3']} threads", "s3_fsspec_default", "s3_fsspec_1"),
            (f"S3 through {report['s3_reader']}, 1 thread", "s3_1", "s3_fsspec_1"),
            (f"S3 through {report['s3_reader']}, {report['default_threads']['s3']} threads (default)", "s3_default", "s3_fsspec_1")]
    for label, key, base in rows:
        seconds = summary[f"{key}_seconds"]
        print(f"| {label} | {seconds:.2f} | {gb / seconds:.2f} | {summary[f'{base}_seconds'] / seconds:.2f}x |")
    if args.out:
        write_results(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
