"""Reads in flight against an endpoint with first-byte latency (issue 16): the loader's ``read_threads``.

moto on loopback answers in well under a millisecond, so the number of requests in flight hardly
matters there (RESULTS.md: 4, 8 and 16 read threads read the same). A real object store answers
each request after a first-byte latency of its own, and the way to full throughput is many requests
at once (AWS's performance guidelines: scale connections horizontally, fetch byte ranges in
parallel). This benchmark adds a fixed wait to every request of the moto server
(``MotoS3(latency_ms=...)``, a sleep, so waits on different connections overlap as they would on
a real endpoint) and reads one epoch of the same store with several ``read_threads`` values, both
range readers, interleaved and repeated; the local filesystem at the loader's default is the
baseline of the same run. The latency is an assumption of the run, stated in its output, not a
measurement of any endpoint.

    python -m benchmarks.bench_object_store s3-latency --latency-ms 20 --threads 4,8,16,32 --out results.json
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

from benchmarks.bench_object_store import range_reader, read_epoch, write_store
from benchmarks.common import machine_info, write_results
from tests.support.s3 import MotoS3, upload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="wait added to every S3 request")
    parser.add_argument("--threads", default="4,8,16,32", help="read_threads values, comma-separated")
    parser.add_argument("--readers", default="obstore,fsspec", help="range readers (HSSTORE_RANGE_READER)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=49_152)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--prefetch-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--endpoint-processes", type=int, default=1)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    readers = args.readers.split(",")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-s3-latency-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base = {"token_budget": args.token_budget, "prefetch_batches": args.prefetch_batches, "shuffle_window": 1024, "seed": 0}
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "latency_ms": args.latency_ms,
        "settings": {**base, "hidden": args.hidden, "endpoint_processes": args.endpoint_processes},
    }
    runs: dict[str, list[dict[str, Any]]] = {"local": []}
    try:
        with MotoS3(processes=args.endpoint_processes, latency_ms=args.latency_ms) as s3:
            os.environ.update(s3.environ())
            local = workdir / "store"
            shutil.rmtree(local, ignore_errors=True)
            report["store"] = write_store(local, hidden=args.hidden, num_tokens=args.tokens, mean_len=600, max_len=2048, shard_tokens=8192, seed=0)
            url = "s3://bench/store"
            upload(local, url)
            s3.freeze()
            for _ in range(args.repeats):
                runs["local"].append(read_epoch(str(local), {**base, "read_threads": 4}))
                for reader in readers:
                    for n in threads:
                        with range_reader(reader):
                            s3.requests(reset=True)
                            run = read_epoch(url, {**base, "read_threads": n})
                            run["requests"] = s3.requests(reset=True)
                        runs.setdefault(f"{reader}-{n}", []).append(run)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report["runs"] = runs
    local_tps = statistics.median(r["tokens_per_s"] for r in runs["local"])
    bytes_per_token = report["store"]["bytes"] / report["store"]["num_tokens"]
    report["summary"] = {
        "local_tokens_per_s": round(local_tps),
        "s3": {
            name: {"tokens_per_s": round(tps), "vs_local": round(tps / local_tps, 3), "mb_per_s": round(tps * bytes_per_token / 1e6),
                   "requests": int(statistics.median(sum(v for k, v in r["requests"].items() if k in ("GET", "HEAD")) for r in values))}
            for name, values in runs.items() if name != "local"
            for tps in [statistics.median(r["tokens_per_s"] for r in values)]
        },
    }
    print(f"\nstore: {report['store']['num_tokens']:,} tokens, {report['store']['num_shards']} shards, "
          f"{bytes_per_token:,.0f} bytes/token; moto with {args.latency_ms:g} ms added per request, "
          f"{args.endpoint_processes} process(es); medians of {args.repeats}")
    print("\n| read path | read_threads | tokens/s | vs local | MB/s | requests/epoch |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| local filesystem | 4 | {local_tps:,.0f} | 1.00x | {local_tps * bytes_per_token / 1e6:,.0f} | - |")
    for name, row in report["summary"]["s3"].items():
        reader, n = name.rsplit("-", 1)
        print(f"| S3, {reader} | {n} | {row['tokens_per_s']:,} | {row['vs_local']:.2f}x | {row['mb_per_s']:,} | {row['requests']} |")
    if args.out:
        write_results(args.out, report)
    return 0

