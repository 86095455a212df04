"""The loader against an endpoint with a cloud store's latency, and that endpoint's own ceiling, in
one run (issue 32.2): does one loader process keep its trainers fed, and how much of what the
endpoint can serve does it take?

moto's S3 server on loopback answers at once; a cloud store answers each request after a
first-byte latency (tens of ms), and the way to throughput is many requests in flight. Here every
request of the moto server waits ``--latency-ms`` (``MotoS3.set_latency``: a sleep, so waits on
different connections overlap as on a real endpoint; set once the store is in the bucket, so the
upload does not pay it). The latency is an assumption of the run, stated in its output, not a
measurement of any endpoint.

Each repeat, interleaved:

1. **the loader**: a fresh :class:`hsstore.StreamingLoader` on the ``s3://`` URL with the loader's
   defaults for object storage (or ``--loader-threads`` overrides), ``--epochs`` epochs of packed
   batches (stored bits, released at once as a trainer that keeps up would), timed from opening
   the store to the last batch. Every ranged GET it sends is recorded (the obstore reader's calls).
2. **the endpoint's ceiling** (the denominator): the same GETs (objects, ranges, sizes, order),
   sent by bare obstore calls from ``--ceiling-threads`` threads, nothing done with the bytes; two
   bare clients, ``get_range`` (one buffer per GET) and a streamed body dropped piece by piece.
   The ceiling is the best median of every client and thread count, in tokens/s: the tokens the
   loader read over the seconds the same GETs take bare. Beside it, not in it, ``get_range_copy``:
   the same GETs each copied once into a buffer, as any reader that keeps the bytes must; and
   ``read_into_copy``: the loader's own GET call (:meth:`ObstoreRangeReader.read_into`) into one
   buffer, without the chunks' scatter and crc32c checks.

``--endpoint-cpus N`` puts the endpoint's processes on the first N cores and this process on the
rest (:mod:`benchmarks.object_store.cpus`); every run records this process's CPU seconds per GB and
how busy each side's cores were.

Every GET call is timed (the loader's too): the median call and the mean number under way say
whether a loader below the ceiling has slower GETs or fewer of them in flight.

Summary: the loader's tokens/s (median), the ceiling, their ratio, and ``trainers_fed_per_process``
(the loader's tokens/s over one H200 trainer's demand, 25,000 tokens/s of the Qwen3-8B shape).
``--cluster-json`` merges issue 32's keys (``s3_latency_ms``, ``loader_tokens_per_s``,
``endpoint_ceiling_tokens_per_s``, ``trainers_fed_per_process``) into that file, keeping its others.

    python -m benchmarks.bench_object_store s3-latency --latency-ms 20 --endpoint-processes 8 \\
        --tokens 262144 --out s3-latency.json --cluster-json benchmarks/results/cluster.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import hsstore
from benchmarks.bench_object_store import FEATURES, write_store
from benchmarks.common import machine_info, write_results
from benchmarks.object_store.cpus import cpu_use, pin, process_group, split_cpus
from hsstore.storage.s3_reads import (
    BODIES,
    BODY_ENV_VAR,
    STREAM_PIECE_BYTES,
    ObstoreRangeReader,
    configured_body,
)
from tests.support.s3 import MotoS3

# What one H200 trains per second on the Qwen3-8B shape (issue 32: ~25-32k tokens/s; the low end).
TRAINER_TOKENS_PER_S = 25_000
AIM_TRAINERS = 3  # the loader reads at least three trainers' demand ...
AIM_SHARE_OF_CEILING = 0.8  # ... and at least this share of the endpoint's bare-GET ceiling
# Whole objects at once in the warm-up pass: a shard file of the 8B shape is ~200 MB, so few.
WARMUP_THREADS = 8
COPY_CLIENT = "get_range_copy"  # bare GETs plus one copy of each body: beside the ceiling, not in it
# The loader's own GET call (ObstoreRangeReader.read_into: obstore.get, the body, Scatter's copy) into
# one buffer, no chunks, no checks: beside the ceiling too; against COPY_CLIENT it isolates the call.
INTO_CLIENT = "read_into_copy"
BESIDE_CEILING = (COPY_CLIENT, INTO_CLIENT)

_Range = tuple[str, int, int]  # (bucket/key, start, end) of one ranged GET


def timed(call: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
    """``call``, appending how long each of its calls took to ``seconds``."""

    def timed_call(*args: Any) -> Any:
        began = time.perf_counter()
        try:
            return call(*args)
        finally:
            seconds.append(time.perf_counter() - began)

    return timed_call


def get_timing(get_seconds: list[float], wall_seconds: float) -> dict[str, float]:
    """Where a reader below the ceiling loses: slower GETs (the median call), or fewer in flight
    (the calls' summed time over the run's: the mean number of GETs under way)."""
    return {"get_seconds_median": statistics.median(get_seconds), "gets_in_flight_mean": sum(get_seconds) / wall_seconds}


@contextlib.contextmanager
def recorded_gets() -> Iterator[tuple[list[_Range], list[float]]]:
    """Every ranged GET the obstore reader sends inside the block (both of its entry points), and
    how long each call took (the GET, and for ``read_into`` the copy and checks it runs)."""
    ranges: list[_Range] = []
    seconds: list[float] = []
    plain_read, plain_into = ObstoreRangeReader.read, ObstoreRangeReader.read_into
    timed_read, timed_into = timed(plain_read, seconds), timed(plain_into, seconds)

    def read(self: ObstoreRangeReader, path: str, start: int, end: int) -> memoryview:
        ranges.append((path, start, end))
        return timed_read(self, path, start, end)

    def read_into(self: ObstoreRangeReader, path: str, start: int, buffers: list[Any], on_filled: Any = None) -> int:
        ranges.append((path, start, start + sum(memoryview(b).nbytes for b in buffers)))
        return timed_into(self, path, start, buffers, on_filled)

    ObstoreRangeReader.read, ObstoreRangeReader.read_into = read, read_into  # type: ignore[method-assign]
    try:
        yield ranges, seconds
    finally:
        ObstoreRangeReader.read, ObstoreRangeReader.read_into = plain_read, plain_into  # type: ignore[method-assign]


def read_with_loader(url: str, settings: dict[str, Any], epochs: int) -> dict[str, Any]:
    """``epochs`` epochs from a fresh loader, timed from opening the store to the last batch."""
    with recorded_gets() as (ranges, get_seconds):
        started = time.perf_counter()
        loader = hsstore.StreamingLoader(url, FEATURES, **settings)
        tokens = first_tokens = 0
        first = None
        for batch in loader.batches(max_epochs=epochs):
            if first is None:
                first, first_tokens = time.perf_counter() - started, batch.num_real_tokens
            tokens += batch.num_real_tokens
            batch.release()
        seconds = time.perf_counter() - started
    assert first is not None, "the store gave no batch"
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "first_batch_s": first,
        "steady_tokens_per_s": (tokens - first_tokens) / max(1e-9, seconds - first),
        "read_threads": loader.read_threads,
        "prefetch_batches": loader.prefetch_batches,
        "buffer_sets_allocated": loader._buffers.num_allocated,  # fresh batch buffers: page faults, once per loader
        "gets": len(ranges),
        "get_bytes": sum(end - start for _, start, end in ranges),
        **get_timing(get_seconds, seconds),
        "ranges": ranges,
    }


def bare_clients(reader: ObstoreRangeReader) -> dict[str, Callable[[_Range], int]]:
    """The bare ways to GET a range, each returning the bytes received and keeping none, and one
    that copies each body once into a buffer of its thread's (``get_range_copy``): what any client
    that keeps the bytes does, the loader's one copy into the batch without its crc32c and packing.
    Only the bare clients are the ceiling (see :func:`summarize`)."""
    import obstore

    def get_range(r: _Range) -> int:
        return len(reader.read(*r))

    local = threading.local()

    def get_range_copy(r: _Range) -> int:
        body = np.frombuffer(reader.read(*r), dtype=np.uint8)
        buffer = getattr(local, "buffer", None)
        if buffer is None or buffer.nbytes < body.nbytes:
            buffer = local.buffer = np.empty(body.nbytes, dtype=np.uint8)
        np.copyto(buffer[: body.nbytes], body)  # without the GIL, as the loader copies into the batch
        return body.nbytes

    def read_into_copy(r: _Range) -> int:
        path, start, end = r
        buffer = getattr(local, "into", None)
        if buffer is None or buffer.nbytes < end - start:
            buffer = local.into = np.empty(end - start, dtype=np.uint8)
        return reader.read_into(path, start, [buffer[: end - start]])

    def streamed(r: _Range) -> int:
        path, start, end = r
        bucket, _, key = path.partition("/")
        result = obstore.get(reader._store(bucket), key, options={"range": (start, end)})
        return sum(len(piece) for piece in result.stream(min_chunk_size=STREAM_PIECE_BYTES))

    return {"get_range": get_range, "streamed": streamed, COPY_CLIENT: get_range_copy, INTO_CLIENT: read_into_copy}


def read_every_object(read: Callable[[_Range], int], local: Path, url: str, threads: int) -> int:
    """Each file of the ``local`` store, as uploaded to ``url``, read whole once through ``read``."""
    prefix = url.removeprefix("s3://")
    ranges = [(f"{prefix}/{path.relative_to(local).as_posix()}", 0, path.stat().st_size)
              for path in sorted(local.rglob("*")) if path.is_file()]
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, ranges))


def replay(read: Callable[[_Range], int], ranges: list[_Range], threads: int) -> dict[str, float]:
    """The GETs ``ranges`` from ``threads`` threads at once, in the loader's order."""
    get_seconds: list[float] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(timed(read, get_seconds), ranges))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes": nbytes, "mb_per_s": nbytes / seconds / 1e6, **get_timing(get_seconds, seconds)}


def loader_variant(name: str) -> tuple[int | None, str | None, float | None]:
    """``THREADS[/BODY][@MS]`` (``default``, ``16``, ``default/stream``, ``32@0.5``...): read_threads
    (None: the loader's own), HSSTORE_S3_BODY (None: the default) and the interpreter's switch
    interval in ms for the run (None: as it is, 5 ms unless set): issue 32's GIL lead, A/B in one run."""
    name_body, _, switch = name.partition("@")
    threads, _, body = name_body.partition("/")
    if body and body not in BODIES:
        raise SystemExit(f"--loader-threads {name!r}: body {body!r} is not one of {', '.join(BODIES)}")
    switch_s = None
    if switch:
        try:
            switch_s = float(switch) / 1000
        except ValueError:
            switch_s = 0.0  # refused below, with the same message
        if switch_s <= 0:
            raise SystemExit(f"--loader-threads {name!r}: the switch interval {switch!r} is not a number of ms above 0")
    return (None if threads == "default" else int(threads)), (body or None), switch_s


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """``sys.setswitchinterval(seconds)`` inside the block (None: unchanged), restored after."""
    before = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def body_handling(body: str | None) -> Iterator[None]:
    """HSSTORE_S3_BODY set to ``body`` for the readers built inside the block."""
    before = os.environ.get(BODY_ENV_VAR)
    if body is not None:
        os.environ[BODY_ENV_VAR] = body
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(BODY_ENV_VAR, None)
        else:
            os.environ[BODY_ENV_VAR] = before


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="wait added to every S3 request (after the upload)")
    parser.add_argument("--endpoint-processes", type=int, default=1, help="moto server processes (MotoS3.freeze)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=98_304, help="tokens in the store")
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=1, help="epochs per loader run")
    parser.add_argument("--loader-threads", default="default",
                        help="loader runs, comma-separated THREADS[/BODY][@MS]: read_threads ('default': the loader's own for "
                             "s3://), HSSTORE_S3_BODY (whole or stream; unset: whole) and the interpreter's switch interval in ms "
                             "(unset: as it is), e.g. default,16,default/stream,32@0.5; the first is the headline")
    parser.add_argument("--endpoint-cpus", type=int, default=None,
                        help="pin the endpoint's processes to the first N cores and this process to the rest "
                             "(unset: both share every core); each run records how busy each side was")
    parser.add_argument("--prefetch-batches", type=int, default=None, help="override the loader's default read-ahead")
    parser.add_argument("--ceiling-threads", default="16,32,64", help="concurrent bare GETs, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no repeat that would end past this many seconds from the start (at least one runs)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="the full results (JSON)")
    parser.add_argument("--cluster-json", default=None, help="merge issue 32's keys into this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_started = time.perf_counter()
    variants = {name: loader_variant(name) for name in args.loader_threads.split(",")}
    headline = next(iter(variants))
    ceiling_threads = [int(n) for n in args.ceiling_threads.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-s3-latency-"))
    workdir.mkdir(parents=True, exist_ok=True)
    base: dict[str, Any] = {"token_budget": args.token_budget, "shuffle_window": 1024, "seed": 0}
    if args.prefetch_batches is not None:
        base["prefetch_batches"] = args.prefetch_batches
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.bench_object_store s3-latency", *(argv if argv is not None else sys.argv[2:])]),
        "machine": machine_info(),
        "latency_ms": args.latency_ms,
        "settings": {**base, "hidden": args.hidden, "epochs": args.epochs, "endpoint_processes": args.endpoint_processes,
                     "features": "aux [3, H] + final [H], bf16, default chunks"},
    }
    own_cpus = os.sched_getaffinity(0)  # given back at the end (--endpoint-cpus narrows them)
    loader_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    ceiling_runs: dict[str, list[dict[str, float]]] = {}
    try:
        with MotoS3(processes=args.endpoint_processes) as s3:
            s3.export()
            local = workdir / "store"
            shutil.rmtree(local, ignore_errors=True)
            started = time.perf_counter()
            report["store"] = write_store(local, hidden=args.hidden, num_tokens=args.tokens, mean_len=600, max_len=2048, shard_tokens=8192, seed=0)
            url = "s3://bench/store"
            s3.load(local, url)
            s3.freeze()
            s3.set_latency(args.latency_ms)
            sides = {"all": sorted(own_cpus)}
            if args.endpoint_cpus:  # the endpoint on cores of its own, as a real store is (cpus.py)
                sides = dict(zip(("endpoint", "client"), split_cpus(args.endpoint_cpus), strict=True))
                report["pinned_threads"] = {"endpoint": pin(process_group(s3.process.pid), sides["endpoint"]),
                                            "client": pin([os.getpid()], sides["client"])}
            report["cpus"] = sides
            report["setup_seconds"] = round(time.perf_counter() - started, 1)
            reader = ObstoreRangeReader(url, {})
            clients = bare_clients(reader)
            # Untimed: every object read bare once. The endpoint's first read of an object is slow,
            # and the ceiling, timed after the loader, never paid it (on the VM this pass took most
            # of the first timed loader run's loss away: LOG, 2026-12-05; with several endpoint
            # processes it reaches each object in one of them). Then what a process pays once
            # (imports, obstore's client, botocore's credential chain); the runs below each open
            # the store afresh. The first timed run can still be slow: the medians want >= 3 repeats.
            warmup = time.perf_counter()
            report["endpoint_warmup_bytes"] = read_every_object(clients["get_range"], local, url, WARMUP_THREADS)
            report["endpoint_warmup_s"] = round(time.perf_counter() - warmup, 2)
            warmup = time.perf_counter()
            next(hsstore.StreamingLoader(url, FEATURES, **base).batches(max_epochs=1)).release()
            report["warmup_first_batch_s"] = round(time.perf_counter() - warmup, 2)
            for repeat in range(args.repeats):
                repeat_started = time.perf_counter()
                names = list(variants)
                for name in names[repeat % len(names):] + names[: repeat % len(names)]:  # each in every position
                    threads, body, switch_s = variants[name]
                    settings = {**base, **({} if threads is None else {"read_threads": threads})}
                    s3.requests(reset=True)
                    with body_handling(body), switch_interval(switch_s), cpu_use(sides) as cpu:
                        run = read_with_loader(url, settings, args.epochs)
                        run["switch_interval_s"] = sys.getswitchinterval()
                    run["cpu"] = cpu
                    run["body"] = body or configured_body()
                    run["requests"] = s3.requests(reset=True)
                    ranges = run.pop("ranges")
                    loader_runs[name].append(run)
                    if name == headline:
                        tokens, replayed = run["tokens"], ranges
                    print(f"repeat {repeat}: loader ({name}) {run['tokens_per_s']:,.0f} tokens/s", flush=True)
                for client, read in clients.items():
                    for threads in ceiling_threads:
                        with cpu_use(sides) as cpu:
                            bare = replay(read, replayed, threads)
                        bare["cpu"] = cpu
                        bare["tokens_per_s"] = tokens / bare["seconds"]
                        ceiling_runs.setdefault(f"{client}-{threads}", []).append(bare)
                print(f"repeat {repeat}: ceiling " + ", ".join(f"{k} {v[-1]['tokens_per_s']:,.0f}" for k, v in ceiling_runs.items()), flush=True)
                now = time.perf_counter()
                if args.deadline_s is not None and now - run_started + (now - repeat_started) > args.deadline_s:
                    report["stopped_early"] = f"after {repeat + 1} repeats: another would end past --deadline-s {args.deadline_s:g}"
                    break
    finally:
        pin([os.getpid()], sorted(own_cpus))
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report["loader_runs"] = loader_runs
    report["ceiling_runs"] = ceiling_runs
    report["summary"] = summarize(loader_runs, ceiling_runs, headline, args.latency_ms)
    print_summary(report)
    if args.out:
        write_results(args.out, report)
    if args.cluster_json:
        cluster = Path(args.cluster_json)
        merge_cluster_keys(cluster, report, os.path.relpath(args.out, cluster.parent) if args.out else None)
    return 0


def summarize(loader_runs: dict[str, list[dict[str, Any]]], ceiling_runs: dict[str, list[dict[str, float]]], headline: str, latency_ms: float) -> dict[str, Any]:
    def med(runs: list[dict[str, Any]], key: str) -> float:
        return float(statistics.median(run[key] for run in runs))

    ceilings = {name: med(runs, "tokens_per_s") for name, runs in ceiling_runs.items()}
    best = max((name for name in ceilings if not name.startswith(BESIDE_CEILING)), key=ceilings.__getitem__)
    copies = {name: value for name, value in ceilings.items() if name.startswith(COPY_CLIENT)}
    loaders = {
        name: {
            "tokens_per_s": round(med(runs, "tokens_per_s")),
            "steady_tokens_per_s": round(med(runs, "steady_tokens_per_s")),
            "first_batch_s": round(med(runs, "first_batch_s"), 3),
            "share_of_ceiling": round(med(runs, "tokens_per_s") / ceilings[best], 3),
            "read_threads": runs[0]["read_threads"],
            "body": runs[0].get("body"),
            "prefetch_batches": runs[0]["prefetch_batches"],
            "gets_per_run": int(med(runs, "gets")),
            "mean_get_bytes": round(med(runs, "get_bytes") / max(1, med(runs, "gets"))),
            "get_seconds_median": round(med(runs, "get_seconds_median"), 4),
            "gets_in_flight_mean": round(med(runs, "gets_in_flight_mean"), 1),
            "switch_interval_s": runs[0].get("switch_interval_s"),
            **cpu_summary(runs),
        }
        for name, runs in loader_runs.items()
    }
    loader_tps = loaders[headline]["tokens_per_s"]
    return {
        "s3_latency_ms": latency_ms,
        "loader_tokens_per_s": loader_tps,
        "endpoint_ceiling_tokens_per_s": round(ceilings[best]),
        "endpoint_ceiling_client": best,
        "loader_share_of_ceiling": round(loader_tps / ceilings[best], 3),
        "trainers_fed_per_process": round(loader_tps / TRAINER_TOKENS_PER_S, 2),
        "aim_met": loader_tps >= AIM_TRAINERS * TRAINER_TOKENS_PER_S and loader_tps >= AIM_SHARE_OF_CEILING * ceilings[best],
        "loaders": loaders,
        "ceilings_tokens_per_s": {name: round(value) for name, value in ceilings.items()},
        "ceiling_gets": {name: {"get_seconds_median": round(med(runs, "get_seconds_median"), 4),
                                "gets_in_flight_mean": round(med(runs, "gets_in_flight_mean"), 1), **cpu_summary(runs)}
                         for name, runs in ceiling_runs.items()},
        # The loader against bare GETs that also copy each body once (its one unavoidable pass).
        "loader_share_of_get_and_copy": round(loader_tps / max(copies.values()), 3) if copies else None,
    }


def cpu_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over ``runs`` of this process's CPU seconds per GB read and of each side's cores' busy share."""
    runs = [run for run in runs if "cpu" in run]
    if not runs:
        return {}
    gb = [run.get("get_bytes", run.get("bytes", 0)) / 1e9 for run in runs]
    return {
        "process_cpu_s_per_gb": round(statistics.median(run["cpu"]["process_cpu_s"] / max(g, 1e-9) for run, g in zip(runs, gb, strict=True)), 3),
        "busy": {side: statistics.median(run["cpu"]["busy"][side] or 0.0 for run in runs) for side in runs[0]["cpu"]["busy"]},
    }


def print_summary(report: dict[str, Any]) -> None:
    s, store = report["summary"], report["store"]
    print(f"\nstore: {store['num_tokens']:,} tokens, {store['num_samples']} samples, {store['num_shards']} shards, "
          f"{store['bytes'] / store['num_tokens']:,.0f} bytes/token; moto with {s['s3_latency_ms']:g} ms per request, "
          f"{report['settings']['endpoint_processes']} process(es); medians of {len(next(iter(report['loader_runs'].values())))}")
    print("\n| read path | reads in flight | tokens/s | share of the ceiling | past the first batch | first batch s | GETs | mean GET MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in s["loaders"].items():
        print(f"| loader ({name}) | {row['read_threads']} | {row['tokens_per_s']:,} | {row['share_of_ceiling']:.2f} | "
              f"{row['steady_tokens_per_s']:,} | {row['first_batch_s']:.2f} | {row['gets_per_run']} | {row['mean_get_bytes'] / 1e6:.1f} |")
    for name, tps in s["ceilings_tokens_per_s"].items():
        client, threads = name.rsplit("-", 1)
        what = {COPY_CLIENT: "GETs + one copy", INTO_CLIENT: "the loader's GET call, one buffer"}.get(client, f"bare GETs, {client}")
        print(f"| {what} | {threads} | {tps:,} | {tps / s['endpoint_ceiling_tokens_per_s']:.2f} | | | | |")
    for name, row in [*((f"loader ({n})", r) for n, r in s["loaders"].items()), *s["ceiling_gets"].items()]:
        if "busy" in row:
            busy = ", ".join(f"{side} {share:.0%}" for side, share in row["busy"].items())
            print(f"cpu: {name}: {row['process_cpu_s_per_gb']:.2f} s of this process per GB; cores busy: {busy}")
    print(f"\nloader {s['loader_tokens_per_s']:,} tokens/s = {s['loader_share_of_ceiling']:.2f} of the endpoint's ceiling "
          f"({s['endpoint_ceiling_tokens_per_s']:,}, {s['endpoint_ceiling_client']}); {s['trainers_fed_per_process']:.2f} trainers "
          f"of {TRAINER_TOKENS_PER_S:,} tokens/s; aim (>= {AIM_TRAINERS} trainers and >= {AIM_SHARE_OF_CEILING:.0%} of the ceiling): "
          f"{'met' if s['aim_met'] else 'not met'}")
    if s.get("loader_share_of_get_and_copy") is not None:
        print(f"loader = {s['loader_share_of_get_and_copy']:.2f} of the best client that copies each body once")


def merge_cluster_keys(path: Path, report: dict[str, Any], details: str | None) -> None:
    """Issue 32's object-storage keys into ``path`` (the cluster results), its other keys kept;
    ``details``: the full results' path relative to it."""
    s = report["summary"]
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update({key: s[key] for key in ("s3_latency_ms", "loader_tokens_per_s", "endpoint_ceiling_tokens_per_s", "trainers_fed_per_process")})
    merged["s3_latency"] = {
        "loader_share_of_ceiling": s["loader_share_of_ceiling"],
        "endpoint_ceiling_client": s["endpoint_ceiling_client"],
        "aim_met": s["aim_met"],
        "store_tokens": report["store"]["num_tokens"],
        "endpoint_processes": report["settings"]["endpoint_processes"],
        "nproc": report["machine"].get("nproc"),
        "date": report["machine"].get("date"),
        "details": details,
    }
    write_results(path, merged)
