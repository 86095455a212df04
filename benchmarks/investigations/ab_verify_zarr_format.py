"""A/B in one run: ``hsstore verify --no-checksums`` of a many-shard store on moto S3, its arrays
opened with ``zarr_format=3`` (hsstore's stores are Zarr v3 only) vs unspecified (zarr then also
probes for v2 metadata, more requests per array), alternating, medians.

Usage: ``python -m benchmarks.investigations.ab_verify_zarr_format [--shards 100] [--repeats 3] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zarr

from benchmarks.bench_object_store import write_store
from benchmarks.common import machine_info, write_results
from hsstore.storage import StoreLocation
from hsstore.verify import verify_store
from tests.support.s3 import MotoS3, upload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    plain = zarr.open_array

    def probing(*a, **k):  # what verify called before: no zarr_format
        k.pop("zarr_format", None)
        return plain(*a, **k)

    workdir = Path(tempfile.mkdtemp(prefix="ab-zarr-format-"))
    runs: dict[str, list[float]] = {"zarr_format_3": [], "unspecified": []}
    try:
        with MotoS3() as s3:
            s3.export()
            write_store(workdir / "store", hidden=64, num_tokens=args.shards * 512, mean_len=128, max_len=512,
                        shard_tokens=512, seed=0, fixed_len=128)
            upload(workdir / "store", "s3://ab-zarr/store")
            for _ in range(args.repeats):
                for name, open_array in (("unspecified", probing), ("zarr_format_3", plain)):
                    zarr.open_array = open_array
                    started = time.perf_counter()
                    assert verify_store(StoreLocation("s3://ab-zarr/store"), checksums=False) == []
                    runs[name].append(round(time.perf_counter() - started, 3))
    finally:
        zarr.open_array = plain
        shutil.rmtree(workdir, ignore_errors=True)
    medians = {name: statistics.median(times) for name, times in runs.items()}
    report = {"command": " ".join(["ab_verify_zarr_format.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine_info(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shards": args.shards, "runs": runs,
              "median_seconds": medians, "speedup": round(medians["unspecified"] / medians["zarr_format_3"], 2)}
    print(f"| verify --no-checksums, {args.shards} shards on moto S3 | runs (s) | median |\n|---|---|---:|")
    for name, times in runs.items():
        print(f"| {name} | {' / '.join(f'{t:.2f}' for t in times)} | {medians[name]:.2f} s |")
    print(f"speedup {report['speedup']}x")
    if args.out:
        write_results(args.out, report)
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
