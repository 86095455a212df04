"""Training on 3 of 6 captured aux layers: bytes read and tokens/s vs a store holding only those 3
(issue 15, "Subset reads"), CPU, one machine.

One run writes the same synthetic aux states (6 layers ``[6, H]``, sample lengths log-normal
around ``--mean-len``) three ways and reads one epoch of packed batches (stored bits) from each
with the same :class:`hsstore.loader.StreamingLoader` settings:

- ``6 layers, layer_arrays`` (one Zarr array per layer), reading layers ``[1, 3, 4]``;
- ``6 layers, one array`` (the default layout, and every store written before), reading the same
  3 layers: the whole rows are read and the 3 kept;
- ``3 layers only`` (a store extracted with just those layers, default layout), reading all:
  the baseline the issue names.

Bytes read are counted where hsstore's range reader asks the filesystem for them
(``ArrayReader._read_bytes``: chunk data, crc32c trailers, the edge chunks' rows outside the range,
the shard indexes), so they are what a network filesystem or object store would transfer.
Epochs are repeated (warm page cache), runs interleaved, medians reported.

Usage: ``python -m benchmarks.bench_store layer-subset [--quick] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import hsstore
from benchmarks.common import machine_info, write_results
from hsstore import FeatureSpec, Lineage
from hsstore.format.array_reader import ArrayReader

CAPTURED = [2, 6, 10, 14, 18, 22]
CHOSEN = [1, 3, 4]  # indices: layers 6, 14, 18


class ByteCounter:
    """Sums the bytes hsstore's range reader requests from the filesystem (wraps ``_read_bytes``)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._plain = ArrayReader._read_bytes

    def __enter__(self) -> ByteCounter:
        counter = self

        def counted(reader: Any, shard: int, offset: int, nbytes: int, into: Any = None) -> Any:
            with counter._lock:
                counter.bytes += nbytes
                counter.requests += 1
            return counter._plain(reader, shard, offset, nbytes, into)

        ArrayReader._read_bytes = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        ArrayReader._read_bytes = self._plain  # type: ignore[method-assign]


def write(path: Path, *, hidden: int, codec: str, layers: list[int], layer_arrays: bool, lengths: list[int]) -> int:
    shutil.rmtree(path, ignore_errors=True)
    spec = FeatureSpec(name="aux_hidden_states", shape=(len(layers), hidden), codec=codec, layer_arrays=layer_arrays)
    lineage = Lineage(aux_layer_ids=[CAPTURED[i] for i in layers], code_version="bench_layer_subset")
    block = np.random.default_rng(0).standard_normal((max(lengths), len(CAPTURED), hidden), dtype=np.float32)
    with hsstore.StoreWriter(str(path), [spec], lineage, shard_max_tokens=1 << 20) as writer:
        for i, n in enumerate(lengths):
            writer.add_sample(
                sample_id=f"s{i}", source_id=f"r{i}", input_ids=np.zeros(n, np.int32), loss_mask=np.ones(n, np.uint8),
                features={"aux_hidden_states": block[:n, layers]},
            )
    return hsstore.open_store(str(path)).manifest.num_bytes


def epoch(path: Path, layers: list[int] | None, settings: dict[str, Any]) -> dict[str, float]:
    loader = hsstore.StreamingLoader(
        str(path), ["aux_hidden_states"], layers=None if layers is None else {"aux_hidden_states": layers}, **settings
    )
    with ByteCounter() as counter:
        started = time.perf_counter()
        tokens = 0
        for batch in loader.batches(max_epochs=1):
            tokens += batch.num_real_tokens
            batch.release()
        seconds = time.perf_counter() - started
    return {"tokens": tokens, "bytes_read": counter.bytes, "reads": counter.requests, "tokens_per_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--mean-len", type=int, default=600)
    parser.add_argument("--codec", default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.tokens, args.repeats = 256, 4096, 1
    rng = np.random.default_rng(1)
    lengths: list[int] = []
    while sum(lengths) < args.tokens:
        lengths.append(int(np.clip(rng.lognormal(np.log(args.mean_len), 0.6), 32, 2048)))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-layer-subset-"))
    settings = {"token_budget": 4096, "shuffle_window": 1024, "read_threads": 4, "prefetch_batches": 4, "seed": 0}
    all_layers = list(range(len(CAPTURED)))
    layouts = {
        "6 layers, layer_arrays: read 3": (dict(layers=all_layers, layer_arrays=True), CHOSEN),
        "6 layers, one array: read 3": (dict(layers=all_layers, layer_arrays=False), CHOSEN),
        "3 layers only: read 3 (baseline)": (dict(layers=CHOSEN, layer_arrays=False), None),
        "6 layers, layer_arrays: read 6": (dict(layers=all_layers, layer_arrays=True), None),
    }
    report: dict[str, Any] = {
        "command": " ".join(["bench_layer_subset.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine_info(),
        "settings": {**settings, "hidden": args.hidden, "codec": args.codec, "captured": CAPTURED, "chosen_ids": [CAPTURED[i] for i in CHOSEN], "num_samples": len(lengths), "tokens": sum(lengths)},
        "layouts": {},
    }
    try:
        paths = {}
        for k, (name, (write_args, _)) in enumerate(layouts.items()):
            if write_args in [layouts[n][0] for n in list(layouts)[:k]]:  # same store as an earlier layout
                paths[name] = paths[next(n for n in list(layouts)[:k] if layouts[n][0] == write_args)]
                continue
            paths[name] = workdir / f"store-{k}"
            report["layouts"].setdefault(name, {})["store_bytes"] = write(paths[name], hidden=args.hidden, codec=args.codec, lengths=lengths, **write_args)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in layouts}
        for _ in range(args.repeats + 1):  # the first pass warms the page cache and is dropped
            for name, (_, chosen) in layouts.items():
                runs[name].append(epoch(paths[name], chosen, settings))
        for name in layouts:
            kept = runs[name][1:] or runs[name]
            entry = report["layouts"].setdefault(name, {})
            entry.update({
                "bytes_read": int(statistics.median(r["bytes_read"] for r in kept)),
                "reads": int(statistics.median(r["reads"] for r in kept)),
                "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in kept)),
                "runs": runs[name],
            })
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    base = report["layouts"]["3 layers only: read 3 (baseline)"]
    subset = report["layouts"]["6 layers, layer_arrays: read 3"]
    report["subset_read_bytes_ratio"] = round(subset["bytes_read"] / base["bytes_read"], 4)
    print(f"\nH={args.hidden} {args.codec}, {len(lengths)} samples, {sum(lengths):,} tokens; layers {report['settings']['chosen_ids']} of {CAPTURED}")
    print("\n| layout | bytes read / epoch | vs baseline | reads / epoch | tokens/s | vs baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, entry in report["layouts"].items():
        print(f"| {name} | {entry['bytes_read']:,} | {entry['bytes_read'] / base['bytes_read']:.3f}x | {entry['reads']:,} | {entry['tokens_per_s']:,} | {entry['tokens_per_s'] / base['tokens_per_s']:.2f}x |")
    print(f"\nsubset_read_bytes_ratio: {report['subset_read_bytes_ratio']}")
    if args.out:
        write_results(args.out, report)
    return 0

