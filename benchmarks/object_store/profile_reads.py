"""Where the loader's S3 read time goes (issue 16): thread time per phase, for several read_threads.

Reads one epoch of a synthetic store (benchmarks/bench_object_store.py's) from moto on loopback
through obstore, ``--repeats`` times per ``read_threads`` value, with the local filesystem at the
same value after each series (the baseline of the same run). Each S3 epoch reports tokens/s (whole
epoch, and past its first batch) and the thread time summed over the read threads in the three
things a read thread does per ranged GET: the GET itself (``S3Backend.read_range`` and
``read_range_into``), the copy into the batch (``hsstore.format.array_reader.copy_rows`` where the
body arrives whole and is checked before its copy, ``hsstore.read_cache.Scatter.write`` where it is
streamed into place, inside the GET's time) and the crc32c of every chunk. The phases are timed
by wrapping those functions in this process (a few microseconds per call; the GETs are ~10 MB
each, the pieces 1 MiB).

    python -m benchmarks.bench_object_store profile-reads --threads 8,16,32 --endpoint-processes 8 --tokens 98304
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hsstore.format.array_reader as array_reader
from benchmarks.bench_object_store import range_reader, read_epoch, write_store
from benchmarks.common import machine_info, write_results
from hsstore.read_cache import Scatter
from hsstore.storage import S3Backend
from tests.support.s3 import MotoS3, upload


class PhaseTimes:
    """Thread time per phase, summed over threads, from wrapped functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
                    self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def take(self) -> dict[str, Any]:
        with self._lock:
            out = {"seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "calls": dict(self.calls)}
            self.seconds, self.calls = {}, {}
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="8,16", help="read_threads values, comma-separated")
    parser.add_argument("--endpoint-processes", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=49_152)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefetch-batches", default="4", help="prefetch_batches values, comma-separated (each with every --threads)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    phases = PhaseTimes()
    plain = (Scatter.write, array_reader.copy_rows, array_reader.crc32c_bytes, S3Backend.read_range, S3Backend.read_range_into)
    # The copy into the batch: a streamed body piece by piece as it arrives (read_cache.Scatter,
    # within the GET's time: obstore's read_into), or a whole body's chunks once each is checked.
    Scatter.write = phases.wrap("copy", Scatter.write)  # type: ignore[method-assign]
    array_reader.copy_rows = phases.wrap("copy", array_reader.copy_rows)  # a whole body's chunks, once checked
    array_reader.crc32c_bytes = phases.wrap("crc32c", array_reader.crc32c_bytes)  # type: ignore[assignment]
    S3Backend.read_range = phases.wrap("get", S3Backend.read_range)  # type: ignore[method-assign]
    S3Backend.read_range_into = phases.wrap("get", S3Backend.read_range_into)  # type: ignore[method-assign]

    workdir = Path(tempfile.mkdtemp(prefix="profile-s3-reads-"))
    report: dict[str, Any] = {
        "command": " ".join(["profile_s3_reads.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": {},
    }
    try:
        with MotoS3(processes=args.endpoint_processes) as s3:
            s3.export()
            report["store"] = write_store(workdir / "store", hidden=args.hidden, num_tokens=args.tokens, mean_len=600, max_len=2048, shard_tokens=8192, seed=0)
            upload(workdir / "store", "s3://bench/store")
            s3.freeze()
            for threads, prefetch in [(int(t), int(p)) for p in args.prefetch_batches.split(",") for t in args.threads.split(",")]:
                settings = {"token_budget": 4096, "read_threads": threads, "prefetch_batches": prefetch, "shuffle_window": 1024, "seed": 0}
                name = f"threads_{threads}" + (f"_prefetch_{prefetch}" if prefetch != 4 else "")
                series = report["runs"].setdefault(name, {"s3_obstore": [], "local": []})
                with range_reader("obstore"):
                    for _ in range(args.repeats):
                        phases.take()
                        epoch = read_epoch("s3://bench/store", settings)
                        series["s3_obstore"].append({**epoch, "phases": phases.take()})
                        print(f"{name} s3 obstore: {epoch['tokens_per_s']:>9,.0f} tokens/s, past the first batch "
                              f"{epoch['steady_tokens_per_s']:>9,.0f}; thread seconds {series['s3_obstore'][-1]['phases']['seconds']}", flush=True)
                epoch = read_epoch(str(workdir / "store"), settings)
                series["local"].append(epoch)
                print(f"{name} local:      {epoch['tokens_per_s']:>9,.0f} tokens/s, past the first batch {epoch['steady_tokens_per_s']:>9,.0f}", flush=True)
    finally:
        Scatter.write, array_reader.copy_rows, array_reader.crc32c_bytes, S3Backend.read_range, S3Backend.read_range_into = plain  # type: ignore[method-assign]
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        write_results(args.out, report)
    return 0

