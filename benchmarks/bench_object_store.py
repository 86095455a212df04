"""Training reads from object storage vs the local filesystem (issue 16, part 1), CPU, one machine.

Two measurements, one run:

1. **Read throughput**: one synthetic store (bf16 ``aux_hidden_states [3, H]`` + ``final_hidden_state
   [H]``, default chunks, sample lengths log-normal around ``--mean-len``) is written to a local
   folder, then copied object by object into moto's S3 server on loopback (tests/support/s3.py: a
   separate process, as an endpoint would be, counting the requests it serves). The same
   :class:`hsstore.loader.StreamingLoader` settings read one epoch of packed batches (stored bits,
   what the host hands a GPU) from each, interleaved and repeated; medians are reported. Also
   measured: the S3 epoch with a local :class:`hsstore.read_cache.ReadCache` (first epoch fills it,
   the second reads from it), the S3 epoch through s3fs instead of the default reader (obstore, where
   installed), and the endpoint's own ceiling: the same ranged GETs the loader sent, issued by bare
   ``s3fs.cat_file`` / obstore calls from as many threads, with no loader at all.
2. **Time to the first batch** of a store of ``--ttfb-shards`` shards (small features), opened from
   S3 in a fresh process: from ``open_store`` to the first batch in hand (imports excluded), then
   again with the cache filled (a resumed run on the same node).

Usage: ``python -m benchmarks.bench_object_store [--quick] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import hsstore
from benchmarks.common import REPO_ROOT, machine_info, run_modes, write_results
from hsstore import FeatureSpec, Lineage
from hsstore.read_cache import ReadCache
from hsstore.storage.s3_reads import ENV_VAR as RANGE_READER_ENV
from hsstore.storage.s3_reads import ObstoreRangeReader
from tests.support.s3 import MotoS3, upload

FEATURES = ["aux_hidden_states", "final_hidden_state"]
NUM_AUX = 3


def write_store(
    path: Path, *, hidden: int, num_tokens: int, mean_len: int, max_len: int, shard_tokens: int, seed: int, fixed_len: int | None = None
) -> dict[str, Any]:
    """A synthetic bf16 store at ``path``: random values (throughput does not depend on them).
    With ``fixed_len`` every sample has that length (a shard then holds exactly
    ``shard_tokens / fixed_len`` samples: a store of an exact shard count)."""
    rng = np.random.default_rng(seed)
    specs = [
        FeatureSpec(name="aux_hidden_states", shape=(NUM_AUX, hidden)),
        FeatureSpec(name="final_hidden_state", shape=(hidden,)),
    ]
    lineage = Lineage(aux_layer_ids=[2, 4, 5], max_length=max_len, code_version="bench_object_store")
    # bf16 bits drawn directly (uint16 of normal-ish bf16 values) would skip the encoder; go through
    # the writer with float32 like extraction does, but reuse one block of values to save CPU.
    block = rng.standard_normal((max_len, NUM_AUX, hidden), dtype=np.float32)
    final = rng.standard_normal((max_len, hidden), dtype=np.float32)
    written = 0
    index = 0
    with hsstore.StoreWriter(str(path), specs, lineage, shard_max_tokens=shard_tokens) as writer:
        while written < num_tokens:
            length = fixed_len or int(np.clip(rng.lognormal(np.log(mean_len), 0.6), 16, max_len))
            writer.add_sample(
                sample_id=f"s{index:07d}",
                source_id=f"r{index}",
                input_ids=rng.integers(0, 32000, length).astype(np.int32),
                loss_mask=np.ones(length, dtype=np.uint8),
                features={"aux_hidden_states": block[:length], "final_hidden_state": final[:length]},
            )
            written += length
            index += 1
    store = hsstore.open_store(str(path))
    return {"num_samples": store.num_samples, "num_tokens": store.num_tokens, "num_shards": len(store.shards), "bytes": store.manifest.num_bytes}


@contextlib.contextmanager
def range_reader(name: str) -> Iterator[None]:
    """``HSSTORE_RANGE_READER=name`` for the block (read when a StoreLocation is built, so open
    the store inside it), then as it was before."""
    before = os.environ.get(RANGE_READER_ENV)
    os.environ[RANGE_READER_ENV] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RANGE_READER_ENV, None)
        else:
            os.environ[RANGE_READER_ENV] = before


def read_epoch(store: str | hsstore.Store, settings: dict[str, Any], cache: ReadCache | None = None) -> dict[str, Any]:
    """One epoch of packed batches (stored bits), timed from opening (a URL) to the last batch."""
    started = time.perf_counter()
    loader = hsstore.StreamingLoader(store, FEATURES, cache=cache, **settings)
    tokens = first_tokens = 0
    first = None
    for batch in loader.batches(max_epochs=1):
        if first is None:
            first, first_tokens = time.perf_counter() - started, batch.num_real_tokens
        tokens += batch.num_real_tokens
        batch.release()  # as the trainer does once the batch is on the GPU: its buffers take a later batch
    seconds = time.perf_counter() - started
    # steady: past the first batch (opening, planning, the first reads), what a long epoch runs at.
    steady = (tokens - first_tokens) / max(1e-9, seconds - first) if first is not None else 0.0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "first_batch_s": first, "steady_tokens_per_s": steady}


class RangeRecorder:
    """Records the (path, start, end) of every ranged GET the loader's readers send, by wrapping
    the filesystem's ``cat_file`` (for the endpoint-ceiling replay)."""

    def __init__(self, fs: Any):
        self.fs = fs
        self.ranges: list[tuple[str, int, int]] = []
        self._plain = fs.cat_file

    def __enter__(self) -> RangeRecorder:
        def cat_file(path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
            if start is not None and end is not None:
                self.ranges.append((path, start, end))
            return self._plain(path, start=start, end=end, **kwargs)

        self.fs.cat_file = cat_file
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fs.cat_file = self._plain


def replay(fs: Any, ranges: list[tuple[str, int, int]], threads: int, read: Any = None) -> dict[str, float]:
    """The same ranged GETs with bare client calls from ``threads`` threads (s3fs's ``cat_file``, or
    ``read(path, start, end)``): what the endpoint serves that client with no loader at all."""
    read = read or (lambda path, start, end: fs.cat_file(path, start=start, end=end))
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(lambda r: len(read(*r)), ranges))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": nbytes, "requests": len(ranges), "mb_per_s": nbytes / seconds / 1e6}


TTFB_CHILD = r"""
import json, time
import hsstore
from hsstore.read_cache import ReadCache
cache = ReadCache({cache!r}, 1 << 30) if {cache!r} else None
started = time.perf_counter()
loader = hsstore.StreamingLoader({url!r}, ["aux_hidden_states", "final_hidden_state"], token_budget={budget}, cache=cache)
opened = time.perf_counter()
batches = loader.batches(max_epochs=1)  # held: closing it waits for the reads already in flight
batch = next(batches)
done = time.perf_counter()
batches.close()
print(json.dumps({{"open_and_plan_s": opened - started, "first_batch_s": done - started, "tokens": batch.num_real_tokens}}))
"""


def time_to_first_batch(s3: MotoS3, url: str, budget: int, cache_dir: str | None) -> dict[str, Any]:
    s3.requests(reset=True)
    code = TTFB_CHILD.format(url=url, budget=budget, cache=cache_dir)
    started = time.perf_counter()
    # cwd: `python -c` imports from the working directory first, so the child runs this tree's hsstore.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **s3.environ()}, cwd=REPO_ROOT, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - started
    result["requests"] = s3.requests()
    return result


def median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(run[key] for run in runs))


def local_vs_s3(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=24_576, help="tokens in the throughput store")
    parser.add_argument("--mean-len", type=int, default=600)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--shard-tokens", type=int, default=8192, help="store shard size of the throughput store")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--prefetch-batches", type=int, default=4,
                        help="the same for every read path (the loader's own defaults: 4 locally, 8 on object storage)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttfb-shards", type=int, default=1000)
    parser.add_argument("--ttfb-hidden", type=int, default=64)
    parser.add_argument("--endpoint-processes", type=int, default=1,
                        help="moto server processes: >1 forks the endpoint into that many read-only copies "
                        "once both stores are uploaded (tests/support/s3.py, MotoS3.freeze), as a real "
                        "endpoint scales with connections")
    parser.add_argument("--quick", action="store_true", help="a tiny run (H=256, 4k tokens, 50 shards)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="write the full results here (JSON)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.tokens, args.shard_tokens, args.repeats, args.ttfb_shards = 256, 4096, 2048, 1, 50

    try:
        import obstore  # noqa: F401

        has_obstore = True
    except ImportError:
        has_obstore = False
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-object-store-"))
    workdir.mkdir(parents=True, exist_ok=True)
    settings = {"token_budget": args.token_budget, "read_threads": args.read_threads, "prefetch_batches": args.prefetch_batches, "shuffle_window": 1024, "seed": 0}
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {**settings, "hidden": args.hidden, "features": "aux [3, H] + final [H], bf16, default chunks",
                     "endpoint_processes": args.endpoint_processes},
    }
    try:
        with MotoS3(processes=args.endpoint_processes) as s3:
            s3.export()
            local = workdir / "store"
            shutil.rmtree(local, ignore_errors=True)
            report["store"] = write_store(local, hidden=args.hidden, num_tokens=args.tokens, mean_len=args.mean_len, max_len=args.max_len, shard_tokens=args.shard_tokens, seed=0)
            url = "s3://bench/store"
            upload(local, url)
            # The store of many shards for the time to the first batch, uploaded now too: a frozen
            # endpoint takes no writes.
            ttfb_local = workdir / "ttfb-store"
            shutil.rmtree(ttfb_local, ignore_errors=True)
            report["ttfb_store"] = write_store(ttfb_local, hidden=args.ttfb_hidden, num_tokens=args.ttfb_shards * 512, mean_len=128, max_len=512, shard_tokens=512, seed=1, fixed_len=128)
            ttfb_url = "s3://bench/ttfb-store"
            upload(ttfb_local, ttfb_url)
            s3.freeze()  # N read-only server processes from here on (nothing for one)
            # s3: the default reader (HSSTORE_RANGE_READER unset: obstore where installed, hsstore.storage.s3_reads);
            # s3_fsspec: s3fs's cat_file, the reader before obstore became the default.
            runs: dict[str, list[dict[str, Any]]] = {"local": [], "s3": [], "s3_fsspec": [], "s3_cached_2nd_epoch": []}
            requests: list[dict[str, int]] = []
            for repeat in range(args.repeats):
                runs["local"].append(read_epoch(str(local), settings))
                s3.requests(reset=True)
                with range_reader("auto"):
                    store = hsstore.open_store(url)
                    report["s3_reader"] = store.location.range_reader
                    runs["s3"].append(read_epoch(store, settings))
                requests.append(s3.requests(reset=True))
                with range_reader("fsspec"):
                    store = hsstore.open_store(url)
                    with RangeRecorder(store.location.fs) as recorder:
                        runs["s3_fsspec"].append({**read_epoch(store, settings), "requests": s3.requests(reset=True)})
                if repeat == 0:  # the endpoint's ceiling: the same ranged GETs, bare clients, no loader
                    report["endpoint_ceiling"] = replay(store.location.fs, recorder.ranges, args.read_threads)
                    if has_obstore:
                        reader = ObstoreRangeReader(url, {})
                        report["endpoint_ceiling_obstore"] = replay(store.location.fs, recorder.ranges, args.read_threads, reader.read)
                cache_dir = workdir / f"cache-{repeat}"
                shutil.rmtree(cache_dir, ignore_errors=True)
                cache = ReadCache(cache_dir, 64 << 30)
                with range_reader("auto"):
                    read_epoch(url, settings, cache)  # fills the cache
                    s3.requests(reset=True)
                    runs["s3_cached_2nd_epoch"].append({**read_epoch(url, settings, cache), "requests": s3.requests(reset=True)})
                shutil.rmtree(cache_dir, ignore_errors=True)
            report["runs"] = runs
            report["s3_requests"] = requests
            store_bytes = report["store"]["bytes"]
            report["summary"] = {
                "local_tokens_per_s": round(median(runs["local"], "tokens_per_s")),
                "s3_tokens_per_s": round(median(runs["s3"], "tokens_per_s")),
                "s3_reader": report["s3_reader"],
                "s3_fsspec_tokens_per_s": round(median(runs["s3_fsspec"], "tokens_per_s")),
                "s3_cached_2nd_epoch_tokens_per_s": round(median(runs["s3_cached_2nd_epoch"], "tokens_per_s")),
                # Past each epoch's first batch (the time to it is measured on its own below).
                "steady_tokens_per_s": {name: round(median(r, "steady_tokens_per_s")) for name, r in runs.items() if r},
                "s3_requests_per_epoch": int(statistics.median(sum(v for k, v in r.items() if k in ("GET", "HEAD", "PUT", "POST")) for r in requests)),
                "s3_get_bytes_per_epoch": int(statistics.median(r.get("response_bytes", 0) for r in requests)),
                "store_bytes": store_bytes,
                "s3_cached_2nd_epoch_requests": int(statistics.median(sum(v for k, v in run["requests"].items() if k in ("GET", "HEAD")) for run in runs["s3_cached_2nd_epoch"])),
            }

            # Time to the first batch: many shards, small features.
            cache_dir = str(workdir / "ttfb-cache")
            report["ttfb"] = {
                "cold": [time_to_first_batch(s3, ttfb_url, 2048, None) for _ in range(args.repeats)],
                "cache_fill": time_to_first_batch(s3, ttfb_url, 2048, cache_dir),
                "cached": [time_to_first_batch(s3, ttfb_url, 2048, cache_dir) for _ in range(args.repeats)],
            }
            report["summary"]["first_batch_seconds_1000_shards" if args.ttfb_shards == 1000 else f"first_batch_seconds_{args.ttfb_shards}_shards"] = round(median(report["ttfb"]["cold"], "first_batch_s"), 3)
            report["summary"]["first_batch_seconds_cached"] = round(median(report["ttfb"]["cached"], "first_batch_s"), 3)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print_tables(report)
    if args.out:
        write_results(args.out, report)
    return 0


def print_tables(report: dict[str, Any]) -> None:
    s = report["summary"]
    store = report["store"]
    ceiling = report["endpoint_ceiling"]
    bpt = store["bytes"] / store["num_tokens"]
    print(f"\nstore: {store['num_tokens']:,} tokens, {store['num_samples']} samples, {store['num_shards']} shards, {bpt:,.0f} bytes/token; H={report['settings']['hidden']}; "
          f"moto endpoint: {report['settings'].get('endpoint_processes', 1)} process(es)")
    print("\n| read path | tokens/s | vs local | requests/epoch | GET bytes/epoch |")
    print("|---|---:|---:|---:|---:|")
    print(f"| local filesystem (warm page cache) | {s['local_tokens_per_s']:,} | 1.00x | - | - |")
    print(f"| moto S3 on loopback, the default reader ({s['s3_reader']}) | {s['s3_tokens_per_s']:,} | {s['s3_tokens_per_s'] / s['local_tokens_per_s']:.2f}x | {s['s3_requests_per_epoch']:,} | {s['s3_get_bytes_per_epoch']:,} ({s['s3_get_bytes_per_epoch'] / store['bytes']:.2f}x the store) |")
    print(f"| moto S3, HSSTORE_RANGE_READER=fsspec (s3fs) | {s['s3_fsspec_tokens_per_s']:,} | {s['s3_fsspec_tokens_per_s'] / s['local_tokens_per_s']:.2f}x | - | - |")
    print(f"| moto S3, 2nd epoch from a local ReadCache | {s['s3_cached_2nd_epoch_tokens_per_s']:,} | {s['s3_cached_2nd_epoch_tokens_per_s'] / s['local_tokens_per_s']:.2f}x | {s['s3_cached_2nd_epoch_requests']:,} | - |")
    ceiling_tps = ceiling["mb_per_s"] * 1e6 / (s["s3_get_bytes_per_epoch"] / max(1, store["num_tokens"]))
    print(f"| endpoint ceiling: the same ranged GETs, bare s3fs | {ceiling_tps:,.0f} (equiv.) | {ceiling_tps / s['local_tokens_per_s']:.2f}x | {ceiling['requests']:,} | {ceiling['mb_per_s']:,.0f} MB/s |")
    if "endpoint_ceiling_obstore" in report:
        c = report["endpoint_ceiling_obstore"]
        c_tps = c["mb_per_s"] * 1e6 / (s["s3_get_bytes_per_epoch"] / max(1, store["num_tokens"]))
        print(f"| endpoint ceiling: the same ranged GETs, bare obstore | {c_tps:,.0f} (equiv.) | {c_tps / s['local_tokens_per_s']:.2f}x | {c['requests']:,} | {c['mb_per_s']:,.0f} MB/s |")
    steady = s.get("steady_tokens_per_s", {})
    if steady:
        print("\npast each epoch's first batch (opening, planning and the first reads excluded): "
              + ", ".join(f"{name} {tps:,} tokens/s ({tps / steady['local']:.2f}x)" for name, tps in steady.items()))
    key = next(k for k in s if k.startswith("first_batch_seconds_") and k != "first_batch_seconds_cached")
    print(f"\ntime to first batch, {report['ttfb_store']['num_shards']} shards from S3 (fresh process, median): {s[key]:.2f} s; with a filled cache: {s['first_batch_seconds_cached']:.2f} s")
    cold = report["ttfb"]["cold"][0]
    print(f"requests of that process (the first batch, and the next group's reads started before it stopped): {cold['requests']}; "
          f"cached: {report['ttfb']['cached'][0]['requests']}")


# Modes: ``python -m benchmarks.bench_object_store MODE --help``; without a mode, :func:`local_vs_s3` runs.
MODES = {
    "s3-latency": "benchmarks.object_store.s3_latency",
    "profile-reads": "benchmarks.object_store.profile_reads",
}


def main(argv: list[str] | None = None) -> int:
    return run_modes(argv, local_vs_s3, MODES, prog="python -m benchmarks.bench_object_store")


if __name__ == "__main__":
    raise SystemExit(main())
